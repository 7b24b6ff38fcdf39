"""The Batch API's jobs: OpenAI's JSONL batches run as a Celery task on a queue of their
own (``batch``), below online traffic.

A batch's record is a Redis hash (:func:`batch_key`): ``b``, the Batch object as JSON, and
``cancel`` once a cancel was asked for. Each request's answer goes into a hash of its own as
it comes (:func:`results_key`: ``custom_id`` -> the output or error line), so a batch that
stops half-way (a cancel, a restart of the runner) goes on later from where it was, and no
request runs twice once its answer is in: the output file, written at the end in the
input's order from those hashes, holds each request exactly once.

The runner (:func:`run_batch`, in ``conveyor batch-runner``, a Celery worker of the
``batch`` queue that ``conveyor serve`` starts) sends each line to the API over HTTP,
exactly as a client would (templates, admission, routing and the stream all apply), at
``CONVEYOR_BATCH_PRIORITY`` (vLLM's priority: online requests, at 0, go first in the
admission wait and the engines' queues), at most ``CONVEYOR_BATCH_MAX_IN_FLIGHT`` at a
time, and only while every pool of the deployment holds less than
``CONVEYOR_BATCH_LOAD_THRESHOLD`` of its workers' request cap (every API replica's
requests, from the routers' shared counts): a batch never takes the room online requests
need. A runner told to stop (its worker's warm shutdown) lets the requests in flight end
(one the API could not answer, as when the whole deployment restarts, is left unanswered)
and returns: the next runner carries on.

Who runs a batch is a lease (:func:`lease_key`, ``CONVEYOR_BATCH_LEASE_S``, renewed while
it runs): a runner takes a batch only if nobody holds it, so two never send the same
requests; one that finds its lease taken (it stalled past it, and another runner took the
batch or a scan queued it) stops sending. Every live runner looks every
``CONVEYOR_BATCH_RECOVER_S`` for batches in progress that nobody holds (their runner
stopped or was killed, their task lost with a restarted Redis's queue) and queues them
again, once: a copy of the task the broker delivers again (a killed runner's, after the
visibility timeout) finds the batch held or done.
"""

from __future__ import annotations

import json
import logging
import secrets
import ssl
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import httpx
import redis
from celery import Task

from cluster.keys import KEY_PREFIX, alive_key, load_key
from cluster.resp import as_str
from tasks.app import app, queue
from tasks.files import DirFileStore, FileStore
from tasks.settings import Settings, get_settings

log = logging.getLogger(__name__)

BATCH_QUEUE = "batch"
# OpenAI's batchable endpoints that Conveyor serves, and vLLM's scoring ones (its run_batch's)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
             "/v1/score", "/v1/rerank")  # fmt: skip
WINDOWS = {"24h": 24 * 3600}
RECORD_TTL_S = 30 * 24 * 3600  # a batch's record and answers, after its creation
POLL_S = 0.05  # the runner looks at the pools' load this often while they are busy
# a request the API could not take (unreachable, 429, 503) is sent again, this many times,
# 0.5 s, 1 s, 2 s... apart (at most 10 s) before its error is the answer
RETRIES, RETRY_S, RETRY_MAX_S = 6, 0.5, 10.0
TERMINAL = ("completed", "failed", "expired", "cancelled")

# set by the batch worker's warm shutdown: runners stop sending and hand their batch on
stopping = threading.Event()


def batch_key(batch_id: str) -> str:
    return f"{KEY_PREFIX}batch:{batch_id}"


def results_key(batch_id: str, kind: str) -> str:
    """HASH custom_id -> output line (``kind`` ``out``) or error line (``err``)."""
    return f"{KEY_PREFIX}batch:{batch_id}:{kind}"


def batches_key() -> str:
    """ZSET batch id -> created_at: every batch, for listing."""
    return f"{KEY_PREFIX}batches"


def lease_key(batch_id: str) -> str:
    """STRING: the runner running the batch (or ``queued`` while its task waits), with a TTL
    its runner renews."""
    return f"{KEY_PREFIX}batch:{batch_id}:lease"


QUEUED_S = 120.0  # a queued task's lease: how long it may wait for a runner

# Take the lease of KEYS[1] for ARGV[1] (ARGV[2] ms) if it is free or only queued; 1 if taken
TAKE_LUA = """
local v = redis.call('GET', KEYS[1])
if v and v ~= 'queued' and v ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# Renew the lease of KEYS[1] for ARGV[1] (ARGV[2] ms) while ARGV[1] holds it, or again if
# it lapsed and nobody took it or queued the batch since; 0 once another has it
RENEW_LUA = """
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# Free the lease of KEYS[1] if ARGV[1] holds it
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


def runners_key() -> str:
    """ZSET batch runner -> when its heartbeat lapses (ms): the API takes batches only while
    one is live."""
    return f"{KEY_PREFIX}batch-runners"


RUNNER_TTL_S = 10.0


def heartbeat(r: redis.Redis, runner_id: str, stop: threading.Event, recover_s: float) -> None:
    """Keep ``runner_id`` live every few seconds, and queue again the batches in progress
    that nobody holds every ``recover_s``, until ``stop`` or the worker's shutdown (a
    thread's loop). A runner shutting down queues nothing: its worker no longer consumes,
    and the message it would send could come back to it and be dropped."""
    recovered = 0.0
    while not stopping.is_set():
        try:
            r.zadd(runners_key(), {runner_id: int((time.time() + RUNNER_TTL_S) * 1000)})
            if time.monotonic() - recovered >= recover_s and not stopping.is_set():
                recovered = time.monotonic()
                recover(r)
        except redis.RedisError as e:
            log.warning("batch runner heartbeat failed: %s", e)
        if stop.wait(min(RUNNER_TTL_S / 3, recover_s)):
            break
    r.zrem(runners_key(), runner_id)


def recover(r: redis.Redis) -> list[str]:
    """Queue again every batch in progress whose lease lapsed; the ids queued."""
    out = []
    for raw_id in r.zrange(batches_key(), 0, -1):
        batch_id = as_str(raw_id)  # type: ignore[arg-type]
        raw = r.hget(batch_key(batch_id), "b")
        if raw is None:
            r.zrem(batches_key(), batch_id)  # expired
            continue
        if json.loads(raw)["status"] in TERMINAL:
            continue
        # queued only if nobody holds it: a runner that just took it keeps it (one check
        # and set, or two runners' scans could both queue it, the second over the first)
        if not r.set(lease_key(batch_id), "queued", px=int(QUEUED_S * 1000), nx=True):
            continue
        log.warning("batch %s: in progress and nobody runs it; queued again", batch_id)
        send(batch_id)
        out.append(batch_id)
    return out


class InvalidInput(ValueError):
    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


def parse_input(data: bytes, endpoint: str) -> list[dict]:
    """A batch's input file: one request per line (``custom_id``, ``method`` POST, ``url``
    the batch's endpoint, ``body``), custom ids unique. :class:`InvalidInput` names the
    first bad line."""
    out, seen = [], set()
    for n, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError as e:
            raise InvalidInput(f"line {n} is not JSON: {e}", n) from None
        if not isinstance(line, dict):
            raise InvalidInput(f"line {n} is not a JSON object", n)
        cid = line.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise InvalidInput(f"line {n}: custom_id must be a non-empty string", n)
        if cid in seen:
            raise InvalidInput(f"line {n}: custom_id {cid!r} is used twice", n)
        seen.add(cid)
        if line.get("method", "POST") != "POST":
            raise InvalidInput(f"line {n}: method must be POST", n)
        if line.get("url") != endpoint:
            raise InvalidInput(f"line {n}: url {line.get('url')!r} is not the batch's "
                               f"endpoint {endpoint}", n)  # fmt: skip
        if not isinstance(line.get("body"), dict):
            raise InvalidInput(f"line {n}: body must be a JSON object", n)
        out.append({"custom_id": cid, "body": line["body"]})
    if not out:
        raise InvalidInput("the input file holds no request")
    return out


def new_batch(input_file_id: str, endpoint: str, window: str, total: int,
              metadata: dict | None) -> dict:  # fmt: skip
    """A Batch object (OpenAI's), in progress."""
    now = int(time.time())
    return {
        "id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": endpoint,
        "errors": None, "input_file_id": input_file_id, "completion_window": window,
        "status": "in_progress", "output_file_id": None, "error_file_id": None,
        "created_at": now, "in_progress_at": now, "expires_at": now + WINDOWS[window],
        "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
        "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": total, "completed": 0, "failed": 0},
        "metadata": metadata,
    }  # fmt: skip


def with_counts(batch: dict, completed: int, failed: int) -> dict:
    """The Batch object with its live request counts (while it runs, from its answers)."""
    if batch["status"] in ("in_progress", "cancelling"):
        counts = {**batch["request_counts"], "completed": completed, "failed": failed}
        return {**batch, "request_counts": counts}
    return batch


def send(batch_id: str) -> None:
    """Queue the batch's task (the caller set its lease to ``queued``: nobody queues it
    again meanwhile)."""
    run_batch.apply_async((batch_id,), queue=queue(BATCH_QUEUE))


# ======================================================================================
# The runner
# ======================================================================================
@app.task(name="conveyor.batch", bind=True, acks_late=True, ignore_result=True)
def run_batch(self: Task, batch_id: str) -> str:
    """Run a batch's requests not answered yet, then write its output and error files."""
    s = get_settings()
    r = redis.Redis.from_url(s.effective_redis_url)
    me = f"{self.request.hostname}:{self.request.id}"
    if not r.eval(TAKE_LUA, 1, lease_key(batch_id), me, int(s.batch.lease_s * 1000)):
        log.info("batch %s: another runner holds it", batch_id)
        return "held elsewhere"
    runner = BatchRunner(s, r, DirFileStore(s.batch.files_dir), batch_id, lease=me)
    try:
        return runner.run()
    finally:  # handed on or done: free for the next runner (its recovery queues it)
        r.eval(RELEASE_LUA, 1, lease_key(batch_id), me)


class BatchRunner:
    def __init__(self, s: Settings, r: redis.Redis, store: FileStore, batch_id: str,
                 stop: threading.Event = stopping, lease: str = "") -> None:  # fmt: skip
        self.s, self.r, self.store, self.id = s, r, store, batch_id
        self.stop = stop
        self.lease, self._renewed = lease, time.monotonic()
        self.lease_s = s.batch.lease_s
        self.url = s.batch.api_url or f"{s.api.scheme}://{_host(s.api.host)}:{s.api.port}"
        self.verify = api_tls(s) if self.url.startswith("https:") else True
        keys = s.api.api_key_list
        self.headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        cap = s.effective_worker_max_requests or 2 * s.engine.max_num_seqs
        self.room = max(1.0, s.batch.load_threshold * cap)  # requests a worker may hold

    def run(self) -> str:
        raw = self.r.hgetall(batch_key(self.id))
        if not raw:
            log.warning("batch %s: no record (expired?); nothing to run", self.id)
            return "missing"
        batch = json.loads({as_str(k): v for k, v in raw.items()}["b"])
        if batch["status"] in TERMINAL:
            return batch["status"]
        lines = parse_input(self.store.read(batch["input_file_id"]) or b"", batch["endpoint"])
        done = {as_str(k) for k in self.r.hkeys(results_key(self.id, "out"))}
        done |= {as_str(k) for k in self.r.hkeys(results_key(self.id, "err"))}
        todo = [line for line in lines if line["custom_id"] not in done]
        log.info("batch %s: %d of %d requests to run", self.id, len(todo), len(lines))
        outcome = self._send_all(batch, todo)
        if outcome in ("handed on", "lost the lease"):
            return outcome
        return self._finish(batch, lines, outcome)

    def _send_all(self, batch: dict, todo: list[dict]) -> str:
        pending: set[Future] = set()
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0, connect=10.0),
                          headers=self.headers, trust_env=False, verify=self.verify) as client, \
                ThreadPoolExecutor(self.s.batch.max_in_flight) as pool:  # fmt: skip
            for line in todo:
                while True:
                    if why := self._interrupted(batch):
                        self._wait_all(pending)
                        return why
                    pending = {f for f in pending if not f.done()}
                    if len(pending) < self.s.batch.max_in_flight and self._room():
                        break
                    if pending:
                        wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                    else:
                        time.sleep(POLL_S)
                pending.add(pool.submit(self._one, client, batch["endpoint"], line))
            self._wait_all(pending)
        return "completed"

    def _wait_all(self, pending: set[Future]) -> None:
        """Wait for the requests in flight, holding the lease meanwhile."""
        while pending:
            _, pending = wait(pending, timeout=self.lease_s / 4)
            self._renew()

    def _renew(self) -> bool:
        """Renew the lease every quarter of its TTL; ``False`` once another holds it."""
        if self.lease and time.monotonic() - self._renewed >= self.lease_s / 4:
            self._renewed = time.monotonic()
            ms = int(self.lease_s * 1000)
            return bool(self.r.eval(RENEW_LUA, 1, lease_key(self.id), self.lease, ms))
        return True

    def _interrupted(self, batch: dict) -> str | None:
        if not self._renew():  # stalled past the lease: another runner may have the batch
            log.warning("batch %s: lease lost; another runner carries on", self.id)
            return "lost the lease"
        if self.stop.is_set():
            return "handed on"
        if self.r.hget(batch_key(self.id), "cancel"):
            return "cancelled"
        if time.time() > batch["expires_at"]:
            return "expired"
        return None

    def _room(self) -> bool:
        """Whether every pool holds less than its share of the workers' cap."""
        now_ms = int(time.time() * 1000)
        for pool in self.s.pools:
            live = [as_str(w) for w in self.r.zrangebyscore(alive_key(pool), now_ms, "+inf")]  # type: ignore[arg-type]
            if not live:
                return False
            reqs = self.r.hmget(load_key(pool), [f"{w}:reqs" for w in live])
            if sum(int(v or 0) for v in reqs) >= self.room * len(live):
                return False
        return True

    def _one(self, client: httpx.Client, endpoint: str, line: dict) -> None:
        """Send one request; its answer becomes an output line (2xx) or an error line."""
        body = {**line["body"], "stream": False}
        if endpoint == "/v1/responses":  # its answer, not a background response's receipt
            body["background"] = False
        body.setdefault("priority", self.s.batch.priority)
        cid = line["custom_id"]
        out: dict[str, Any] = {"id": "batch_req_" + secrets.token_hex(12), "custom_id": cid,
                               "response": None, "error": None}  # fmt: skip
        resp = None
        for attempt in range(RETRIES + 1):
            try:
                resp = client.post(endpoint, json=body)
            except httpx.HTTPError as e:  # the API is away (restarting?): try again
                error = f"the API did not answer: {e}"
            else:
                if resp.status_code not in (429, 503):  # an answer, not "later"
                    break
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if self.stop.is_set():
                return  # not answered: the next runner sends it again
            if attempt < RETRIES:
                time.sleep(min(RETRY_MAX_S, RETRY_S * 2**attempt))
        else:
            if resp is None:
                out["error"] = {"code": "request_failed", "message": error}
                self.r.hset(results_key(self.id, "err"), cid, json.dumps(out))
                return
        assert resp is not None
        answer = _json(resp)
        request_id = resp.headers.get("x-request-id") or (answer or {}).get("id")
        out["response"] = {"status_code": resp.status_code, "request_id": request_id,
                           "body": answer}  # fmt: skip
        if resp.status_code < 400:
            self.r.hset(results_key(self.id, "out"), cid, json.dumps(out))
            return
        err = (answer or {}).get("error") or {}
        out["error"] = {"code": err.get("code") or str(resp.status_code),
                        "message": err.get("message") or f"HTTP {resp.status_code}"}  # fmt: skip
        self.r.hset(results_key(self.id, "err"), cid, json.dumps(out))

    def _finish(self, batch: dict, lines: list[dict], outcome: str) -> str:
        """Write the output and error files (each answer once, in the input's order) and
        close the record."""
        outs = {as_str(k): _b(v) for k, v in self.r.hgetall(results_key(self.id, "out")).items()}
        errs = {as_str(k): _b(v) for k, v in self.r.hgetall(results_key(self.id, "err")).items()}
        now = int(time.time())
        output = b"".join(outs[c] + b"\n" for c in _ids(lines) if c in outs)
        errors = b"".join(errs[c] + b"\n" for c in _ids(lines) if c in errs)
        out_id = err_id = None
        if output:
            out_id = self.store.put(output, f"{self.id}_output.jsonl", "batch_output")["id"]
        if errors:
            err_id = self.store.put(errors, f"{self.id}_error.jsonl", "batch_output")["id"]
        status = outcome  # completed, cancelled or expired
        batch.update(status=status, output_file_id=out_id, error_file_id=err_id,
                     finalizing_at=now, **{f"{status}_at": now},
                     request_counts={"total": len(lines), "completed": len(outs),
                                     "failed": len(errs)})  # fmt: skip
        self.r.hset(batch_key(self.id), "b", json.dumps(batch))
        log.info("batch %s %s: %d answered, %d failed, of %d", self.id, status, len(outs),
                 len(errs), len(lines))  # fmt: skip
        return status


def _ids(lines: list[dict]) -> list[str]:
    return [line["custom_id"] for line in lines]


def _b(v: bytes | str) -> bytes:
    return v.encode() if isinstance(v, str) else v


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return {"error": {"message": resp.text[:500]}}


def _host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def api_tls(s: Settings) -> ssl.SSLContext | bool:
    """How the batch runner checks the API it calls over HTTPS: against the deployment's
    own CA file (``ssl_ca_certs``) or certificate (self-signed: its own CA), by chain, not
    host name (it calls the API by address); it shows the API's certificate and key as
    its own where the API asks for client certificates. A CONVEYOR_BATCH_API_URL elsewhere
    is checked as any HTTPS URL (the system's CAs)."""
    a = s.api
    if s.batch.api_url or not a.ssl_certfile:
        return True
    ctx = ssl.create_default_context(cafile=str(a.ssl_ca_certs or a.ssl_certfile))
    ctx.check_hostname = False
    if a.ssl_cert_reqs:
        ctx.load_cert_chain(str(a.ssl_certfile), str(a.ssl_keyfile) if a.ssl_keyfile else None)
    return ctx


def on_worker_stopping(**_: object) -> None:
    stopping.set()
