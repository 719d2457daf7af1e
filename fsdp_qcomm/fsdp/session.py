"""What one ``enable`` call installed, owned by the model it was installed on.

FSDP2 holds the collectives ``enable`` installs (the all-gather, reduce-scatter and all-reduce
hook objects of every module), and each of them holds the ``Session``; so the session, and with
it every guard, lives exactly as long as the model keeps the hooks, whether or not the caller
kept the ``QCommHandle``. Nothing module-global keeps a session alive: one pair of
``torch.optim`` step hooks, registered while any session lives, reaches the live sessions
through a ``WeakSet``.

Fixed points, the same on every rank:

* before the root module's forward (a forward pre-hook that runs before FSDP's own): the
  installed collectives are still ours (a later ``set_custom_all_gather`` /
  ``set_all_reduce_hook`` would silently undo ``enable``), and one ``change_tracker.Agreement``
  round decides, for every module whose gathers may reuse weights, what changed since its
  previous gather;
* around every ``torch.optim`` optimizer step: which modules' parameters it updated (their next
  gather exchanges a quantized difference), and how many steps the statistics count.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..stats import CommStats
from . import change_tracker
from . import internals as fsdp
from .change_tracker import Agreement, Change, ChangeTracker, describe, values_changed
from .grad_overlap import ReductionQueue


class Session:
    """State of one ``enable`` call (see the module docstring). ``installs`` are
    ``enable._Install`` records; ``agreement_group`` spans every rank of the model's meshes."""

    def __init__(
        self, model: nn.Module, installs: list[Any], stats: CommStats,
        queue: Optional[ReductionQueue], agreement_group: Optional[dist.ProcessGroup],
        solo: Optional[Any] = None,
    ) -> None:
        self.installs = installs
        self.solo = solo  # HSDP: ``hsdp.SoloGroup``
        self.stats = stats
        self.queue = queue
        self.agreement = Agreement(agreement_group, stats)
        self.enabled = True
        self.in_root_forward = False
        self._model_ref = weakref.ref(model)
        self._install_ids = [{id(p) for p in fsdp.sharded_params(i.group)} for i in installs]
        self._digest_due: dict[int, ChangeTracker] = {}  # stepped, digested at the step's end
        self._param_ids = set().union(*self._install_ids)
        # not traced by torch.compile (like FSDP's own hooks); wrapped here, not at import
        before = torch.compiler.disable(self._before_root_forward)
        after = torch.compiler.disable(self._after_root_forward)
        self._hooks = [
            model.register_forward_pre_hook(before, prepend=True),
            model.register_forward_hook(after, always_call=True),
        ]
        _DISPATCH.add(self)
        self._finalizer = None
        if queue is not None:
            self._finalizer = weakref.finalize(self, queue.shutdown)

    @property
    def trackers(self) -> list[ChangeTracker]:
        return [i.all_gather.tracker for i in self.installs
                if i.all_gather is not None and i.all_gather.tracker is not None]

    @property
    def agreeing(self) -> list[ChangeTracker]:
        """The trackers of the gathers that agree before each root forward."""
        return [i.all_gather.tracker for i in self.installs
                if i.all_gather is not None and i.all_gather.agrees]

    # ---- the root forward ------------------------------------------------------------------
    def _before_root_forward(self, module: nn.Module, args: Any) -> None:
        if not self.enabled or fsdp.autograd_running():
            return  # an activation-checkpoint recomputation inside backward: no new forward
        self.check_installed()
        _DISPATCH.forward_begins()
        trackers = self.agreeing
        codes = self.agreement.agree(trackers, "before the root module's forward")
        _refuse_stale_weights(self._held_stale(trackers, codes))
        for t, c in zip(trackers, codes):
            t.pending = c
        self.in_root_forward = True

    def _held_stale(self, agreed: list[ChangeTracker], codes: list[int]
                    ) -> list[tuple[str, str, str]]:
        """(module, how FSDP holds its weights, what changed since) for every module whose
        next forward would compute with weights gathered before its shards changed: from the
        agreed codes (which compared every rank's shard with its digest), from this rank's
        declared and signature facts for trackers outside the agreement (a load counts as a
        change there), and from the optimizer steps and ``mark_changed()`` calls seen while
        held for gathers without a tracker."""
        agreed_code = {id(t): c for t, c in zip(agreed, codes)}
        out = []
        for i in self.installs:
            g = i.all_gather
            if g is None:
                continue
            held = fsdp.holds_gathered(i.group)
            if g.tracker is None:  # no digest: the steps and mark_changed() seen while held
                if held is None:
                    g.changed_while_held = False  # resharded since: the next gather reads shards
                elif g.changed_while_held:
                    out.append((g.name, held, describe(Change.STEP)))
            elif held is not None:
                c = agreed_code.get(id(g.tracker))
                if c is None:  # outside the agreement: this rank's facts, where a load counts
                    c = g.tracker.local_flags(backward=False)
                    stale = values_changed(c) or bool(c & Change.LOADED)
                else:
                    stale = values_changed(c)
                if stale:
                    out.append((g.name, held, _what_changed(c)))
        return out

    def _after_root_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.in_root_forward = False
        for t in self.trackers:
            t.pending = None

    def check_installed(self) -> None:
        """Raise if something replaced the collectives or hooks ``enable`` installed."""
        for i in self.installs:
            gather, scatter = fsdp.installed_comms(i.group)
            if i.all_gather is not None and gather is not i.all_gather:
                raise RuntimeError(
                    f"FSDP module {i.label!r}: its all-gather was replaced after "
                    "fsdp_qcomm.enable() (set_custom_all_gather), so its weights would no longer "
                    "be gathered the way the other modules' are. Call handle.disable() before "
                    "installing another all-gather, or install it before enable()"
                )
            if i.reduce_scatter is not None and scatter is not i.reduce_scatter:
                raise RuntimeError(
                    f"FSDP module {i.label!r}: its reduce-scatter was replaced after "
                    "fsdp_qcomm.enable() (set_custom_reduce_scatter). Call handle.disable() "
                    "before installing another reduce-scatter, or install it before enable()"
                )
            if i.replica is not None:
                i.replica.check_installed()

    # ---- optimizer steps -------------------------------------------------------------------
    def optimizer_step_pre(self, ids: set[int]) -> None:
        if not self.enabled or not ids & self._param_ids:
            return
        self.check_installed()  # HSDP: no step on gradients the replicas did not share
        for t in self.trackers:
            t.optimizer_step_pre(ids)

    def optimizer_step_post(self, ids: set[int], outermost: bool = True) -> None:
        """After a step over the parameters ``ids`` (those with a gradient). The agreeing
        groups it stepped are digested once the outermost step ends (an optimizer container
        such as torchtitan's steps inner optimizers): what a ``p.data`` write after the step
        changes is found against those digests (``change_tracker.step_digests``)."""
        if self.enabled and ids & self._param_ids:
            self._stepped(ids)
        if outermost and self._digest_due:
            due, self._digest_due = list(self._digest_due.values()), {}
            if self.enabled:
                change_tracker.step_digests(due)

    def _stepped(self, ids: set[int]) -> None:
        agreeing = {id(t) for t in self.agreeing}
        for t in self.trackers:
            if t.optimizer_step_post(ids) and id(t) in agreeing:
                t.awaits_step_digest()
                self._digest_due[id(t)] = t
        for i, own in zip(self.installs, self._install_ids):
            if i.all_gather is not None and i.all_gather.tracker is None and ids & own:
                i.all_gather.note_change()
        self.stats.count_step()

    def close(self) -> None:
        """Remove the root hooks and stop the reduction thread (``handle.disable``)."""
        self.enabled = False
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        _DISPATCH.discard(self)
        if self.queue is not None:
            self.queue.drain()
            self.queue.shutdown()

    def release(self) -> None:
        """After the hooks are uninstalled: destroy the groups this session created."""
        if self.solo is not None:
            self.solo.destroy()
            self.solo = None
        group = self.agreement.group
        if group is not None:
            dist.destroy_process_group(group)
            self.agreement.group = None


def _what_changed(code: int) -> str:
    """The value changes in a code, in words: a content change is the optimizer step or load
    that explains it, or the gradient reduction (an optimizer of another kind) that does."""
    c = Change(code)
    shown = c & (Change.STEP | Change.WRITE | Change.LOADED | Change.CONTENT_SINCE_STEP)
    if c & Change.CONTENT and not c & (Change.STEP | Change.LOADED):
        shown |= Change.REDUCED if c & Change.REDUCED else Change.CONTENT
    return describe(shown)


def _refuse_stale_weights(stale: list[tuple[str, str, str]]) -> None:
    """Raise when a module's forward would compute with weights older than its shards
    (``Session._held_stale``: module, how FSDP holds them, what changed): FSDP holds an earlier
    gather's weights, which it uses without gathering the shards again. Every rank raises
    alike: the facts are agreed or SPMD ones, and FSDP's states follow the same program on every
    rank. FSDP2 alone computes with the old weights, without an error
    (``docs/known_issues.md``)."""
    if not stale:
        return
    shown = "; ".join(f"{name or '<root>'!r} ({held}; since then: {what})"
                      for name, held, what in stale[:8])
    more = f" and {len(stale) - 8} more" if len(stale) > 8 else ""
    raise RuntimeError(
        f"fsdp_qcomm: FSDP module(s) {shown}{more} hold weights gathered before their "
        "parameters changed, and FSDP does not gather them again: this forward would compute "
        "with the weights from before the change, as FSDP2 alone does without an error. "
        "Before the optimizer step (or write), leave every FSDP module resharded: "
        "set_reshard_after_backward(True) for the last micro-batch, no unshard() before the "
        "step, reshard() after a forward without backward (an evaluation between backward and "
        "step), and reshard_after_forward=True (set_reshard_after_forward) for a model that "
        "runs forwards only. To go on from here, call reshard() on each module named (after "
        "unshard() on one with an unshard(async_op=True) pending), then run this forward again."
    )


class _Dispatch:
    """The process's one pair of ``torch.optim`` step hooks, registered while a session lives,
    passing each step to the live sessions (held weakly: a dropped model takes its session
    along). The last ``disable`` removes them: nothing of ours runs in a step after it.

    Each thread keeps the steps it is inside of (an optimizer container steps inner
    optimizers; a subclass's ``step`` may call its parent's): a post hook with none left open
    on that thread ends the outermost step. A step that raised never reaches its post hook;
    the thread's next root forward closes what is left (``forward_begins``)."""

    def __init__(self) -> None:
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()
        self._handles: list = []
        self._local = threading.local()

    def _open(self) -> list[tuple[int, set[int]]]:
        """This thread's open steps, outermost first: (optimizer id, its parameters that had
        a gradient before the step)."""
        stack = getattr(self._local, "open", None)
        if stack is None:
            stack = self._local.open = []
        return stack

    def forward_begins(self) -> None:
        """A root forward: no step of this thread is still running (an optimizer's closure
        runs its forward inside the step, which then ends as if outermost: one digest more).
        Digests still due are dropped: their modules re-send exactly
        (``ChangeTracker.awaits_step_digest``), and a digest taken later could hold a write."""
        self._open().clear()
        for s in list(self._sessions):
            s._digest_due.clear()

    def add(self, session: Session) -> None:
        self._sessions.add(session)
        if not self._handles:
            # eager under a compiled optimizer step too: the digests are host work
            self._handles = [
                register_optimizer_step_pre_hook(torch.compiler.disable(self._pre)),
                register_optimizer_step_post_hook(torch.compiler.disable(self._post))]

    def discard(self, session: Session) -> None:
        self._sessions.discard(session)
        if not self._sessions:
            for h in self._handles:
                h.remove()
            self._handles = []
            self._open().clear()

    # Before a step every parameter it covers must be as last explained. A parameter counts
    # as stepped when it had a gradient before or after the step: torch.optim leaves one
    # without a gradient untouched, so a frozen module left in the optimizer sends nothing
    # under qWD; before, for a hook that frees the gradients after the step (per-optimizer
    # post hooks run first), after, for a closure that makes them (LBFGS). FSDP2 gives every
    # rank's shard a gradient (an empty one too) or none, so every rank counts alike; a write
    # without a gradient is found by content.
    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        sessions = list(self._sessions)
        if not sessions:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._open().append((id(optimizer), {id(p) for p in params if p.grad is not None}))
        ids = {id(p) for p in params}
        for s in sessions:
            s.optimizer_step_pre(ids)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        sessions = list(self._sessions)
        if not sessions:
            return
        stack, k, ids = self._open(), id(optimizer), set()
        for i in range(len(stack) - 1, -1, -1):  # its innermost open step, and any inside it
            if stack[i][0] == k:
                ids = stack[i][1]
                del stack[i:]
                break
        ids = ids | {id(p) for g in optimizer.param_groups for p in g["params"]
                     if p.grad is not None}
        for s in sessions:
            s.optimizer_step_post(ids, outermost=not stack)


_DISPATCH = _Dispatch()


__all__ = ["Session"]
