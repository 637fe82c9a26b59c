"""Plans computed ahead of training and shipped to every rank through the job's TCPStore.

Global rank 0 runs a producer: a thread that keeps up to `lookahead` iterations in flight
on a pool of `num_workers` planner processes and publishes each result, in iteration order,
under ``{prefix}/{i}``. Every rank calls `get(i)` (iterations in increasing order): it waits
for the key (timeout names the iteration), checks the record and deserialises it. The last
of `num_readers` ranks to read iteration i deletes its keys and bumps ``{prefix}/completed``,
which is what bounds the look-ahead, so the store holds at most `lookahead` plans.

Records are ``b"P" + iteration(8 bytes) + sha256(32) + payload`` or ``b"E" + iteration +
message``. The payload is `megatron.planner.service.wire`'s fixed-schema record (JSON plus the binary
`ExecutionPlan` format), never a pickle: the store is an unauthenticated port, and nothing read
from it may run code (only rank 0's own worker pipes carry pickles). A planner exception (or a
crashed worker) becomes an error record, and every rank
raises `PlanServiceError` naming the iteration instead of waiting forever. The message holds
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
import shutil
import signal
import tempfile
import struct
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable, Optional

from megatron.planner.service import wire
class PlanServiceError(RuntimeError):
    pass


def default_store():
    from megatron.core.parallel_state import job_store
    try:
        return job_store()
    except RuntimeError as e:
        raise PlanServiceError(f"no store given: {e}") from None


def _run(plan_fn, iteration):
    return wire.encode(plan_fn(iteration))


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
                 start_method: str = "forkserver"):
        if lookahead < 1 or num_workers < 1:
            raise ValueError("lookahead and num_workers must be >= 1")
        self.store = store if store is not None else default_store()
        self.rank, self.num_readers, self.prefix = rank, num_readers, prefix
        self.timeout_s, self.lookahead = timeout_s, lookahead
        self._stop = threading.Event()
        self._thread = None
        self._pool = None
        self._log_dir = None
        if rank == 0:
            if plan_fn is None:
                raise ValueError("rank 0 runs the planner: plan_fn is required")
            self._log_dir = tempfile.mkdtemp(prefix="plan-service-")
            self._pool = cf.ProcessPoolExecutor(num_workers, mp_context=_pool_context(start_method, plan_fn),
                                                initializer=_worker_init, initargs=(self._log_dir,))
            pstore = self.store.clone() if hasattr(self.store, "clone") else self.store
            self._thread = threading.Thread(
                target=self._produce, args=(plan_fn, pstore, start_iteration, num_iterations, num_workers),
                name="plan-service-producer", daemon=True)
            self._thread.start()

    # ---- keys -------------------------------------------------------------------------
    def _key(self, i, suffix=""):
        return f"{self.prefix}/{i}{suffix}"

    # ---- producer (rank 0) --------------------------------------------------------------
    def _produce(self, plan_fn, store, first, count, num_workers):
        pending = {}
        nxt, publish = first, first
        end = None if count is None else first + count
        try:
            while not self._stop.is_set() and (end is None or publish < end):
                completed = first + store.add(f"{self.prefix}/completed", 0)
                # Bounded look-ahead: never more than `lookahead` unread plans in the store.
                while (end is None or nxt < end) and nxt < completed + self.lookahead and len(pending) < self.lookahead + num_workers:
                    pending[nxt] = self._pool.submit(_run, plan_fn, nxt)
                    nxt += 1
                fut = pending.get(publish)
                if fut is None or not fut.done():
                    time.sleep(0.002)
                    continue
                del pending[publish]
                try:
                    payload = fut.result()
                    record = b"P" + struct.pack("<q", publish) + hashlib.sha256(payload).digest() + payload
                except BaseException as e:  # noqa: BLE001 - shipped to every rank
                    if isinstance(e, cf.process.BrokenProcessPool):
                        msg = self._worker_died(publish, e)
                    else:  # the worker's own traceback is chained in as the cause
                        msg = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                    store.set(self._key(publish), b"E" + struct.pack("<q", publish) + msg.encode())
                    return  # ranks stop at this iteration; planning further is pointless
                store.set(self._key(publish), record)
                publish += 1
        except BaseException as e:  # noqa: BLE001 - e.g. store gone: tell whoever waits
            if not self._stop.is_set():
                msg = (self._worker_died(publish, e) if isinstance(e, cf.process.BrokenProcessPool)
                       else f"plan producer died: {e!r}")  # submit() to a pool whose worker died
                try:
                    store.set(self._key(publish), b"E" + struct.pack("<q", publish) + msg.encode())
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
        key = self._key(iteration)
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise PlanServiceError(
                f"rank {self.rank}: no plan for iteration {iteration} after {self.timeout_s:.0f}s "
                f"(is rank 0's plan service running?): {e}") from None
        data = self.store.get(key)
        if data[:1] not in (b"P", b"E") or len(data) < (41 if data[:1] == b"P" else 9):
            raise PlanServiceError(f"rank {self.rank}: record of iteration {iteration} under {key} is not a plan "
                                   f"record ({len(data)} bytes starting {bytes(data[:9])!r}); refusing it")
        kind, it = data[:1], struct.unpack("<q", data[1:9])[0]
        if it != iteration:
            raise PlanServiceError(f"rank {self.rank}: key {key} holds a record for iteration {it}")
        if kind == b"E":
            self._mark_read(iteration)
            raise PlanServiceError(f"planner failed for iteration {iteration}:\n{data[9:].decode(errors='replace')}")
        digest, payload = data[9:41], data[41:]
        if hashlib.sha256(payload).digest() != digest:
            raise PlanServiceError(f"rank {self.rank}: plan of iteration {iteration} is corrupt (digest mismatch)")
        first = self.store.compare_set(self._key(iteration, "/digest"), b"", digest)
        if first != digest:
            raise PlanServiceError(f"rank {self.rank} read a different plan for iteration {iteration} than other ranks")
        try:
            plan = wire.decode(payload)
        except ValueError as e:
            raise PlanServiceError(f"rank {self.rank}: plan of iteration {iteration} refused: {e}") from None
        self._mark_read(iteration)
        return plan

    def _mark_read(self, iteration):
        n = self.store.add(self._key(iteration, "/readers"), 1)
        if n == self.num_readers:  # last reader cleans up and releases a look-ahead slot
            for suffix in ("", "/digest", "/readers"):
                self.store.delete_key(self._key(iteration, suffix))
            self.store.add(f"{self.prefix}/completed", 1)

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
