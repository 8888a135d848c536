"""A task's requests: route -> execute -> resubmit by ``ErrorKind`` -> materialize, or cancel.

``Requests`` is what ``Dispatch`` drives: ``submit(task, stop)`` splits a batch into parts (fan-out by
deadline, or ``microbatch_size``), routes each with its deadline and starts its ``Execute``;
``collect(task, stop)`` blocks on each part's reply (its done-callback wakes the fetcher at once),
resubmits a part whose server was lost — by status code or ``ErrorKind``, never by error text —
and merges the parts into the batch; ``cancel(task)`` gives up what is unread and releases the
slabs of replies that still arrive. Completions ride on the next Route (one RPC per request).
"""

from __future__ import annotations

import sys
import threading
import time

import grpc
import numpy as np

from helix_core.data.contract import CostFeedback
from helix_core.errors import ClusterError
from helix_core.loader.cluster_client import TRANSIENT
from helix_core.memory.merge import merge_batches
from helix_core.planning.fanout import fan_out, sum_costs
from helix_core.tier2.errors import RoundLost
from helix_core.wire.messages import ErrorKind, Part, Task, execute_request

__all__ = ["Requests"]


class Requests:
    """The request path of one loader (its arguments by keyword). ``scheduler`` / ``on_error``:
    the loader's options of those names; ``units(tokens)`` / ``step_units``: GPU cost units for
    the deadline estimator; ``fanout``: split a batch whose predicted CPU time exceeds its
    deadline; ``copy``: materialize into owned memory (pinned / device copies follow);
    ``pad``: a batch that comes back in parts is merged zero-padding its tensors (``pad_collate``,
    or ``microbatch_size`` asked for), else parts whose tensors differ raise as ``default_collate`` would."""

    def __init__(
        self,
        *,
        client,
        spec,
        config,
        stats,
        deadlines,
        units,
        step_units: float,
        scheduler: str,
        on_error: str,
        fanout: bool,
        dataset,
        copy: bool,
        task_ids,
        pad: bool = True,
        tier2=None,
    ):
        self.client, self.spec, self.config, self.stats, self.deadlines = client, spec, config, stats, deadlines
        self.units, self.step_units, self.scheduler, self.on_error = units, step_units, scheduler, on_error
        self.fanout, self.copy, self.task_ids, self.pad = fanout, copy, task_ids, pad
        self.tier2 = tier2  # client.tier2.Tier2: batches go through their round before they are read
        self.observe = dataset.observe_cost if isinstance(dataset, CostFeedback) else None
        self._unread: set = set()  # futures of cancelled requests whose replies are still on their way
        self._cond = threading.Condition()
        self._cancel_lock = threading.Lock()

    # ---- sending --------------------------------------------------------------------------------
    def submit(self, task: Task, stop=None) -> None:
        """Start the batch's requests; ``stop`` (the run's ``Stop``) cuts short a wait for the Coordinator."""
        deadline = self._plan_deadline(task)
        splits = task.splits()
        if self.fanout and len(splits) == 1 and deadline is not None:
            splits = fan_out(task.indices, task.costs, deadline)
            self.stats.fanouts += len(splits) > 1
        offset = 0
        for indices in splits:  # every part first: the first one's request names the others' samples (room)
            task.parts.append(Part(next(self.task_ids), indices, sum_costs(task.costs[offset : offset + len(indices)])))
            offset += len(indices)
        for part in list(task.parts):
            self._start(task, part, stop)

    def _plan_deadline(self, task: Task) -> float | None:
        """Register the batch's predicted GPU cost with the deadline estimator; its deadline."""
        if task.costs and all(c is not None for c in task.costs):
            units = self.units(np.array([c.tokens for c in task.costs], dtype=np.float64))
            self.deadlines.expect(task.seq, float(np.sum(units)) + self.step_units)
        return self.deadlines.deadline(task.seq)

    def _start(self, task: Task, part: Part, stop=None) -> None:
        """Route ``part`` with its deadline and send it; a server that can't even be reached is excluded."""
        while True:
            deadline = self.deadlines.deadline(task.seq)
            t0 = time.perf_counter()
            part.route = route = self.client.route(part, deadline, self.scheduler, stop)
            self.stats.route_us.append((time.perf_counter() - t0) * 1e6)
            self.stats.decision_us.append(route.decision_us)
            self.stats.reasons[route.reason] += 1
            if deadline is not None:
                self.stats.deadlines.append(deadline)
            request = execute_request(
                task,
                part,
                self.spec[0],
                self.on_error,
                self.client.client_id,
                deadline,
                splittable=self.fanout,
                features=self.tier2 is not None,
            )
            try:
                part.future = self.client.execute(route.exec_address, self.spec, request)
            except grpc.RpcError as e:
                if e.code() not in TRANSIENT or part.attempts >= self.config.max_resubmits:
                    raise ClusterError(
                        f"cannot send batch {task.position} to {route.exec_address}: {e.code().name} {e.details()}"
                    ) from None
                self._exclude(part, route.exec_server_id)
                continue
            part.future.add_done_callback(lambda _, p=part: self._landed(p))
            return

    def _landed(self, part: Part) -> None:
        part.landed = time.perf_counter()
        self.client.completed(part.task_id)

    def _exclude(self, part: Part, server_id: str) -> None:
        self.client.forget(part.route.exec_address)
        part.excluded.add(server_id)
        part.attempts += 1
        self.stats.resubmits += 1

    def _resubmit(self, task: Task, part: Part, why: str, server_id: str, stop=None) -> None:
        """``part`` was lost with a server (or its slab): exclude that server and send it again.
        Its task id stays, so a late duplicate is recognised and dropped."""
        if part.attempts >= self.config.max_resubmits:
            raise ClusterError(f"batch {task.position} failed after {part.attempts} resubmits: {why}")
        self._exclude(part, server_id)
        self._start(task, part, stop)

    # ---- fetching -------------------------------------------------------------------------------
    def _wait(self, task: Task, part: Part, stop):
        """The reply of ``part``; on a lost server, exclude it and resubmit (bounded)."""
        while True:
            if not stop.wait(part.future, self.config.execute_timeout_s + self.config.rpc_timeout_s):
                if stop.is_set():
                    raise ClusterError("loader stopped")
                raise ClusterError(
                    f"batch {task.position}: no reply within the batch deadline ({self.config.execute_timeout_s} s)"
                )
            route = part.route
            try:
                reply = part.future.result()
            except grpc.RpcError as e:
                if e.code() not in TRANSIENT:
                    raise ClusterError(f"batch {task.position}: {e.code().name} {e.details()}") from None
                self._resubmit(task, part, f"{e.code().name} {e.details()}", route.exec_server_id, stop)
                continue
            kind = ErrorKind(reply.error_kind)
            if kind.retry:
                lost = route.delivery_server_id if kind is ErrorKind.DELIVERY_LOST else route.exec_server_id
                self._resubmit(task, part, f"{kind.name}: {reply.error}", lost, stop)
                continue
            return reply

    def collect(self, task: Task, stop):
        if self.tier2 is not None:
            batch = self._collect_round(task, stop)
            if batch is not None:
                return batch
        batches, error, grow = [], None, []
        for k, part in enumerate(task.parts):
            while True:
                reply = self._wait(task, part, stop)
                try:  # the first part's slab may hold the room of the others' rows (``grow``)
                    batch = (
                        None
                        if reply.error_kind
                        else self.client.materialize(reply, copy=self.copy, pad=self.pad, grow=grow if k == 0 else None)
                    )
                    break
                except FileNotFoundError:  # its producer died and the slab was swept: run it again
                    self._resubmit(task, part, "slab vanished", part.route.exec_server_id, stop)
            task.taken.add(k)
            self._observe_costs(task, reply)
            self.stats.skipped += len(reply.skipped)
            self.stats.cross_ds_bytes += reply.cross_ds_bytes
            self.stats.stolen += max(0, len(reply.pieces) - 1)
            error = error or self.client.error_of(reply)
            if batch is not None:
                batches.append(batch)
        if error is not None:
            raise error
        task.landed = max(p.landed for p in task.parts)
        self.stats.batch_ready.append(time.perf_counter() - task.t_dispatch)
        if len(batches) == 1:
            return batches[0]
        return merge_batches(
            batches, rows=[len(p.indices) for p in task.parts], pad=self.pad, grow=grow[0] if grow else None
        )

    def _collect_round(self, task: Task, stop):
        """Tier 2: the batch its round made of ``task``'s replies, or None to read them as they are
        (a failed part, or the round kept this rank's samples)."""
        replies = [self._wait(task, part, stop) for part in task.parts]
        if any(r.error_kind for r in replies):
            return None
        try:
            batch = self.tier2.join_round(task, replies, stop)
        except RoundLost as lost:  # its slabs went with a server: decode the samples the round gave it again
            part = Part(next(self.task_ids), lost.indices, None)
            task.parts.append(part)
            self._start(task, part, stop)
            reply = self._wait(task, part, stop)
            error = self.client.error_of(reply)
            if error is not None:
                raise error from None
            batch = self.client.materialize(reply, copy=self.copy, pad=self.pad)
            replies.append(reply)
        if batch is None:
            return None
        for k, reply in enumerate(replies):
            task.taken.add(k)
            self._observe_costs(task, reply)
            self.stats.skipped += len(reply.skipped)
            self.stats.cross_ds_bytes += reply.cross_ds_bytes
            self.stats.stolen += max(0, len(reply.pieces) - 1)
        task.landed = max(p.landed for p in task.parts)
        self.stats.batch_ready.append(time.perf_counter() - task.t_dispatch)
        return batch

    def _observe_costs(self, task: Task, reply) -> None:
        """Measured decode CPU seconds: the prediction error (stats) and the dataset's online cost
        model (``observe_cost``), whose refined estimates the next requests carry to placement."""
        predicted = {i: c.cpu_s for i, c in zip(task.indices, task.costs) if c is not None}
        for index, seconds in zip(reply.decoded, reply.decode_cpu_s):
            if index in predicted:
                self.stats.cost_errors.add(predicted[index], seconds)
            if self.observe is not None:
                self.observe(int(index), float(seconds))

    # ---- giving up --------------------------------------------------------------------------------
    def cancel(self, task: Task) -> None:
        """Cancel a task's unread requests. The RPCs are left to finish (a gRPC cancel can race a
        reply already on the wire and strand its slab): the servers drop tasks not yet started,
        and every reply that still arrives has its slab released. Idempotent."""
        if sys.is_finalizing():  # at exit no RPC can start (its thread never would)
            return
        with self._cancel_lock:  # the fetcher and a shutdown may cancel the same task: release each slab once
            todo = []
            for k, part in enumerate(task.parts):
                fut = part.future
                if fut is None or k in task.taken or fut in task.cancelled:
                    continue
                task.cancelled.add(fut)  # per future: a resubmission made after an earlier cancel is cancelled too
                todo.append((part, fut))
        for part, fut in todo:
            if not fut.done():
                self.client.cancel(part.route.exec_address, [part.task_id])
                with self._cond:
                    self._unread.add(fut)  # close() waits for these, or their slabs would be stranded
            fut.add_done_callback(self._release_reply)

    def _release_reply(self, fut) -> None:
        with self._cond:
            self._unread.discard(fut)
            self._cond.notify_all()
        try:
            reply = fut.result()
        except Exception:
            return
        self.client.release(reply)

    def drain(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) for the replies of cancelled requests; True if none is left."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._unread, timeout_s)
