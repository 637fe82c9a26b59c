"""Plans computed ahead of training and shipped to every rank through the job's TCPStore.

Global rank 0 runs a producer: a thread that keeps up to `lookahead` iterations in flight
on a pool of `num_workers` planner processes and publishes each result, in iteration order,
under ``{prefix}/{i}``. Every rank calls `get(i)` (iterations in increasing order): it waits
for the key (timeout names the iteration), checks the record and deserialises it. The last
of `num_readers` ranks to read iteration i deletes its keys and bumps ``{prefix}/completed``,
which is what bounds the look-ahead, so the store holds at most `lookahead` plans.

Records are ``b"P" + iteration(8 bytes) + job(16) + batch(32) + sha256(32) + payload`` or
``b"E" + iteration + job + message``. `job` is drawn by rank 0 when the service starts and
published under ``{prefix}/job`` (every reader takes it from there once), so a record of
another run is refused; `batch` is the digest of the global batch the plan was computed for
(`batch_digest(iteration)`, computed in the planner worker from the data it planned, and by
every reader from its own batch), so a genuine plan re-labelled for another iteration is
refused; the sha256 covers everything after it and the header. The payload is
`megatron.planner.service.wire`'s fixed-schema record (JSON plus the binary
`ExecutionPlan` format), never a pickle: the store is an unauthenticated port, and nothing read
from it may run code (only rank 0's own worker pipes carry pickles). A planner exception (or a
crashed worker) becomes an error record, and every rank
raises `PlanServiceError` naming the iteration instead of waiting forever. The message (data
from the store: printed quoted, control characters escaped, at most `MAX_ERROR_CHARS`) holds
the worker's traceback: for an exception, the one raised in the worker; for a worker that
died (segfault, abort, killed), what `faulthandler` wrote from that worker's Python stack.

Workers are processes of their own, started by a fork server (a fresh interpreter that
preloads the planner module), never forked from rank 0's training process with its
communication threads. The first reader
of an iteration stores the payload digest with compare-and-set; a rank that reads different
bytes raises, so all ranks of an iteration provably run the same plan. No extra server: only
the store the job already has (`torch.distributed` default store, or any TCPStore passed in).
"""
from __future__ import annotations

import concurrent.futures as cf
import faulthandler
import glob
import hashlib
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import tempfile
import struct
import threading
import time
import traceback
from typing import Callable, Optional

from megatron.planner.service import wire
class PlanServiceError(RuntimeError):
    pass


_PLAN_HEAD = struct.Struct("<cq16s32s32s")  # kind, iteration, job, batch digest, sha256
_ERR_HEAD = struct.Struct("<cq16s")
NO_BATCH = bytes(32)  # a service without `batch_digest` (tests, simple planners)
MAX_ERROR_CHARS = 4000
POLL_S = 2.0  # how often a waiting reader checks that the iterations before it can still finish


def plan_record(iteration: int, job: bytes, batch: bytes, payload: bytes) -> bytes:
    head = struct.pack("<cq16s32s", b"P", iteration, job, batch)
    return head + hashlib.sha256(head + payload).digest() + payload


def error_record(iteration: int, job: bytes, message: str) -> bytes:
    return _ERR_HEAD.pack(b"E", iteration, job) + message.encode(errors="replace")


def quoted(data: bytes, limit: int = MAX_ERROR_CHARS) -> str:
    """Text from the store shown as data: every line prefixed, control characters (terminal
    escapes included) written as escapes, the tail kept when it is long (it names the error)."""
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit:
        text = f"[{len(text) - limit} characters cut] ..." + text[-limit:]
    out = []
    for line in text.split("\n"):
        out.append("  | " + "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in line))
    return "\n".join(out)


def default_store():
    from megatron.core.parallel_state import job_store
    try:
        return job_store()
    except RuntimeError as e:
        raise PlanServiceError(f"no store given: {e}") from None


def _run(plan_fn, batch_digest, iteration):
    # The digest comes from the worker, computed from the data the plan was made for.
    return (batch_digest(iteration) if batch_digest is not None else NO_BATCH), wire.encode(plan_fn(iteration))


_FAULT_LOG = None


def _worker_init(log_dir):
    """Keep a per-worker file where faulthandler dumps the Python stack if the worker dies."""
    global _FAULT_LOG
    # Ctrl-C reaches the whole process group: rank 0 stops and closes this pool; a worker's own
    # KeyboardInterrupt would only add a traceback per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _FAULT_LOG = open(os.path.join(log_dir, f"worker-{os.getpid()}.log"), "w")
    except OSError:  # the service closed while this worker was starting
        return
    faulthandler.enable(_FAULT_LOG, all_threads=True)


def _crash_report(log_dir) -> str:
    out = []
    for path in sorted(glob.glob(os.path.join(log_dir, "worker-*.log"))):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text:
            out.append(f"--- planner worker {os.path.basename(path)[7:-4]} (faulthandler) ---\n{text}")
    return "\n".join(out) or "(the worker left no Python traceback: killed by a signal faulthandler cannot catch?)"


def _forget_inherited_forkserver():
    """A process forked from one that had started a fork server inherits its handle but is not
    the server's parent (multiprocessing then fails with ChildProcessError): start our own."""
    from multiprocessing import forkserver
    fs = forkserver._forkserver
    pid = getattr(fs, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        if fs._forkserver_alive_fd is not None:
            os.close(fs._forkserver_alive_fd)
        fs._forkserver_pid = fs._forkserver_address = fs._forkserver_alive_fd = None


def _pool_context(start_method: str, plan_fn):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        _forget_inherited_forkserver()
        mod = getattr(getattr(plan_fn, "func", plan_fn), "__module__", None)
        ctx.set_forkserver_preload([m for m in (__name__, mod) if m and m != "__main__"])
    return ctx


class PlanService:
    """`plan_fn(iteration) -> plan` runs in worker processes on rank 0 only; the plan is a
    `DynaPipeIterationPlan` or a JSON value (`megatron.planner.service.wire`).

    `plan_fn` is pickled to the workers: a module-level function or a functools.partial of
    one (an unpicklable one fails iteration `start_iteration` with that error on every rank).
    Use as a context manager or call `close()`.
    """

    def __init__(self, plan_fn: Optional[Callable], rank: int, num_readers: int, store=None, *,
                 lookahead: int = 4, num_workers: int = 2, start_iteration: int = 0,
                 num_iterations: Optional[int] = None, prefix: str = "planner", timeout_s: float = 300.0,
                 start_method: str = "forkserver", batch_digest: Optional[Callable[[int], bytes]] = None):
        if lookahead < 1 or num_workers < 1:
            raise ValueError("lookahead and num_workers must be >= 1")
        self.store = store if store is not None else default_store()
        self.rank, self.num_readers, self.prefix = rank, num_readers, prefix
        self.timeout_s, self.lookahead = timeout_s, lookahead
        self.batch_digest, self.first = batch_digest, start_iteration
        self._read = []  # iterations this rank has read and not yet seen completed
        self._suspect = {}  # iteration -> (counter, flags) at the last check
        self.job = None
        self._stop = threading.Event()
        self._thread = None
        self._pool = None
        self._log_dir = None
        if rank == 0:
            if plan_fn is None:
                raise ValueError("rank 0 runs the planner: plan_fn is required")
            self.job = secrets.token_bytes(16)
            self.store.set(f"{prefix}/job", self.job)  # before any record exists
            self._log_dir = tempfile.mkdtemp(prefix="plan-service-")
            self._pool = cf.ProcessPoolExecutor(num_workers, mp_context=_pool_context(start_method, plan_fn),
                                                initializer=_worker_init, initargs=(self._log_dir,))
            pstore = self.store.clone() if hasattr(self.store, "clone") else self.store
            self._thread = threading.Thread(
                target=self._produce, args=(plan_fn, pstore, start_iteration, num_iterations, num_workers,
                                            batch_digest),
                name="plan-service-producer", daemon=True)
            self._thread.start()

    # ---- keys -------------------------------------------------------------------------
    def _key(self, i, suffix=""):
        return f"{self.prefix}/{i}{suffix}"

    # ---- producer (rank 0) --------------------------------------------------------------
    def _produce(self, plan_fn, store, first, count, num_workers, batch_digest):
        pending = {}
        nxt, publish = first, first
        end = None if count is None else first + count
        try:
            while not self._stop.is_set() and (end is None or publish < end):
                completed = first + store.add(f"{self.prefix}/completed", 0)
                # Bounded look-ahead: never more than `lookahead` unread plans in the store.
                while ((end is None or nxt < end) and nxt < completed + self.lookahead
                       and len(pending) < self.lookahead + num_workers):
                    pending[nxt] = self._pool.submit(_run, plan_fn, batch_digest, nxt)
                    nxt += 1
                fut = pending.get(publish)
                if fut is None or not fut.done():
                    time.sleep(0.002)
                    continue
                del pending[publish]
                try:
                    batch, payload = fut.result()
                    record = plan_record(publish, self.job, batch, payload)
                except BaseException as e:  # noqa: BLE001 - shipped to every rank
                    if isinstance(e, cf.process.BrokenProcessPool):
                        msg = self._worker_died(publish, e)
                    else:  # the worker's own traceback is chained in as the cause
                        msg = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                    store.set(self._key(publish), error_record(publish, self.job, msg))
                    return  # ranks stop at this iteration; planning further is pointless
                store.set(self._key(publish), record)
                publish += 1
        except BaseException as e:  # noqa: BLE001 - e.g. store gone: tell whoever waits
            if not self._stop.is_set():
                msg = (self._worker_died(publish, e) if isinstance(e, cf.process.BrokenProcessPool)
                       else f"plan producer died: {e!r}")  # submit() to a pool whose worker died
                try:
                    store.set(self._key(publish), error_record(publish, self.job, msg))
                except Exception:  # noqa: BLE001
                    pass
        finally:
            for f in pending.values():
                f.cancel()

    def _worker_died(self, iteration, e) -> str:
        time.sleep(0.2)  # let the dying worker's faulthandler output reach its file
        return (f"a planner worker process died while iteration {iteration} was planned (or one planned "
                f"beside it: a dead worker fails every pending iteration) ({e}).\n"
                f"Worker traceback:\n{_crash_report(self._log_dir)}")

    # ---- consumers (every rank) ---------------------------------------------------------
    def get(self, iteration: int):
        try:
            return self._get(iteration)
        except PlanServiceError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever a forged record trips (RecursionError, ...): one line
            raise PlanServiceError(f"rank {self.rank}: plan record of iteration {iteration} "
                                   f"under {self._key(iteration)} refused: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:200] if str(e) else ''}"
                                   ) from None

    def _job(self, iteration: int) -> bytes:
        if self.job is None:
            key = f"{self.prefix}/job"
            self._wait(key, iteration, f"no plan for iteration {iteration} (the service's job id {key} never came)")
            job = self.store.get(key)
            if len(job) != 16:
                raise PlanServiceError(f"rank {self.rank}: {key} holds {len(job)} bytes, not a 16-byte job id")
            self.job = job
        return self.job

    def _wait(self, key: str, iteration: int, what: str = "") -> None:
        """Wait for `key`, checking every POLL_S that the iterations this rank has read can
        still finish (their reader counters are not tampered with), so a stuck counter is named
        long before the timeout."""
        deadline = time.monotonic() + self.timeout_s
        next_check, pause = time.monotonic() + POLL_S, 0.0005
        # store.check polls without blocking: a blocking wait with a short timeout would log a
        # c10d warning at every poll.
        while not self.store.check([key]):
            now = time.monotonic()
            if now >= deadline:
                what = what or f"no plan for iteration {iteration}"
                raise PlanServiceError(f"rank {self.rank}: {what} after {self.timeout_s:g}s (is rank 0's plan "
                                       f"service running?)")
            if now >= next_check:
                self._check_counters(iteration if what == "" else None)
                next_check = now + POLL_S
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _check_counters(self, waiting_for: Optional[int]) -> None:
        completed = self.first + self.store.add(f"{self.prefix}/completed", 0)
        self._read = [i for i in self._read if i >= completed]
        self._suspect = {i: v for i, v in self._suspect.items() if i >= completed}
        if waiting_for is not None and completed > waiting_for:
            raise PlanServiceError(
                f"rank {self.rank}: iteration {waiting_for} is counted complete ({self.prefix}/completed) before this "
                f"rank read it: the counter {self._key(waiting_for, '/readers')} or {self.prefix}/completed was "
                f"changed by someone other than the job's ranks")
        for i in self._read:
            key = self._key(i, "/readers")
            n = self.store.add(key, 0)
            flags = sum(self.store.check([self._key(i, f"/read/{r}")]) for r in range(self.num_readers))
            seen, self._suspect[i] = self._suspect.get(i), (n, flags)
            if n != flags and seen == (n, flags):  # the same for a whole poll: not a reader in mid-update
                raise PlanServiceError(
                    f"rank {self.rank}: reader counter {key} is {n} but {flags} of {self.num_readers} ranks have read "
                    f"iteration {i}: it was changed by someone other than the job's ranks and the plan service "
                    f"cannot progress")

    def _get(self, iteration: int):
        key = self._key(iteration)
        job = self._job(iteration)
        self._wait(key, iteration)
        data = self.store.get(key)
        kind = data[:1]
        if kind not in (b"P", b"E") or len(data) < (_PLAN_HEAD.size if kind == b"P" else _ERR_HEAD.size):
            raise PlanServiceError(f"rank {self.rank}: record of iteration {iteration} under {key} is not a plan "
                                   f"record ({len(data)} bytes starting {bytes(data[:9])!r}); refusing it")
        _, it, rec_job = _ERR_HEAD.unpack_from(data)
        if it != iteration:
            raise PlanServiceError(f"rank {self.rank}: key {key} holds a record for iteration {it}; refusing it")
        if rec_job != job:
            raise PlanServiceError(f"rank {self.rank}: record under {key} is from another run "
                                   f"(job {rec_job.hex()[:12]}, this run is {job.hex()[:12]}): "
                                   f"a replayed record; refusing it")
        if kind == b"E":
            self._mark_read(iteration)
            raise PlanServiceError(f"planner failed for iteration {iteration}; its error record under {key} reads:\n"
                                   f"{quoted(data[_ERR_HEAD.size:])}")
        _, _, _, batch, digest = _PLAN_HEAD.unpack_from(data)
        payload = data[_PLAN_HEAD.size:]
        if hashlib.sha256(data[:_PLAN_HEAD.size - 32] + payload).digest() != digest:
            raise PlanServiceError(f"rank {self.rank}: plan of iteration {iteration} is corrupt (digest mismatch)")
        own = self.batch_digest(iteration) if self.batch_digest is not None else NO_BATCH
        if batch != own:
            raise PlanServiceError(f"rank {self.rank}: the plan under {key} was computed for another global batch than "
                                   f"this rank's batch of iteration {iteration} (batch digest {batch.hex()[:12]}, "
                                   f"expected {own.hex()[:12]}): a re-labelled or stale plan; refusing it")
        first = self.store.compare_set(self._key(iteration, "/digest"), b"", digest)
        if first != digest:
            raise PlanServiceError(f"rank {self.rank} read a different plan for iteration {iteration} than other ranks")
        try:
            plan = wire.decode(payload)
        except ValueError as e:
            raise PlanServiceError(f"rank {self.rank}: plan of iteration {iteration} refused: {e}") from None
        if getattr(plan, "iteration", iteration) != iteration:
            raise PlanServiceError(f"rank {self.rank}: the plan under {key} says it is for iteration {plan.iteration}; "
                                   f"refusing it")
        self._mark_read(iteration)
        return plan

    def _mark_read(self, iteration):
        self.store.set(self._key(iteration, f"/read/{self.rank}"), b"1")  # what _check_counters counts
        n = self.store.add(self._key(iteration, "/readers"), 1)
        if n > self.num_readers:
            raise PlanServiceError(f"rank {self.rank}: reader counter {self._key(iteration, '/readers')} is {n}, above "
                                   f"the job's {self.num_readers} readers: it was changed by someone other than the "
                                   f"job's ranks")
        if n == self.num_readers:  # last reader cleans up and releases a look-ahead slot
            for suffix in ("", "/digest", "/readers", *(f"/read/{r}" for r in range(self.num_readers))):
                self.store.delete_key(self._key(iteration, suffix))
            self.store.add(f"{self.prefix}/completed", 1)
        else:
            self._read.append(iteration)

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
