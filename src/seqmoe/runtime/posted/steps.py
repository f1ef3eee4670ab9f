"""The posted engine's controller: `Controller` (`core/controller.py`) with decode steps that post
their routing (model thread) and are read back from the mailbox (control thread). Its parts (the
fence, the mailbox, the relay, the control thread) come through its constructor.

The model thread opens a posted step with `begin_posted` (or `graph_pre` for a step `DecodeGraph`
opened itself), its router hooks `post` each layer's routing, and `end_posted` closes it, cutting it
short (`_cut`) when fewer than L layers were posted. The control thread feeds each posted layer to
the state machine in the inline engine's order (`decode_layer`) and drops a cut step
(`abandon_step`). Where it sits in a decode step: docs/decode.md, "On CUDA: posted and captured".
"""

from __future__ import annotations

import numpy as np
import torch

from seqmoe.runtime.core.controller import Controller, _Open
from seqmoe.runtime.core.signals import critical
from seqmoe.runtime.posted.control_thread import ControlThread


class PostedController(Controller):
    """A `Controller` whose decode steps post their routing (see the module doc).

    Args (beyond `Controller`'s):
        fence: the pool's `ReadFence` (its ledger of forwards).
        mailbox: the routing mailbox (`posted.mailbox.Mailbox`) the router hooks post to.
        relay: the host CPU path of posted decode steps (`posted.host_relay.HostRelay`), or None.
    The control thread (`posted.control_thread.ControlThread`) starts here; `thread.close()` ends it.
    """

    def __init__(self, system, num_layers: int, num_experts: int, top_k: int, meta, *, fence, mailbox, relay=None,
                 **parts) -> None:
        super().__init__(system, num_layers, num_experts, top_k, meta, **parts)
        self.fence, self.mailbox, self.relay = fence, mailbox, relay
        self.thread = ControlThread(self, mailbox, self.lock, on_stop=relay.abort if relay is not None else None)

    def begin_posted(self, token_input: torch.Tensor | None, rows: int = 1) -> None:
        """A decode step of `rows` rows that posts its routing starts (model thread): launch it on
        the control thread; `token_input`: its input ids [rows], or None (DecodeGraph sets them in
        the captured step)."""
        if self.relay is not None:
            self.relay.check()  # a step's host output that never came (device side) fails the next step
        self.open_forward(posted=True)
        self.thread.launch(rows, self.lanes)  # may wait for the control thread: not critical (see `_cut`)
        with critical():
            self.posting, self._token_input, self._posted = True, token_input, 0

    def end_posted(self, posted: int | None = None) -> None:
        """The posting forward returned or raised (model thread); `posted`: layers it posted when
        the hooks did not count them (a replayed graph posts all L). A step that posted fewer
        than L layers is cut short."""
        with critical():
            if posted is not None:
                self._posted = posted
            if self._open is not None and self._posted != self.L:
                self._cut(self._open)
            self._close_relay_step()
            self.posting, self._token_input = False, None
            self._end_ledger()
            self._open = None

    def run_graph_steps(self, on: bool, muted: bool = False) -> None:
        """`DecodeGraph` runs the decode steps from now (`on`) or no longer: the hooks then post and
        neither open nor close anything; `muted`: the mailbox ignores the posts (warm-up, capture)."""
        self.graph_step, self.mailbox.muted = on, muted
        if not on:
            self.posting = False

    def graph_pre(self, token_input: torch.Tensor | None) -> None:
        """Pre-hook of a step DecodeGraph opened itself (or warms up, captures): post, reading nothing."""
        self.posting, self._token_input, self._posted = True, token_input, 0

    def _close_relay_step(self) -> None:
        """The open posted step is over: host jobs still waiting for its hidden states give up."""
        o = self._open
        if self.relay is not None and o is not None and self.thread.launched > o.launched_before:
            self.relay.close_step(o.launched_before)

    def _abort_posted(self, o: _Open) -> None:
        self._cut(o)
        self._close_relay_step()

    def _cut(self, o: _Open) -> None:
        """Tell the control thread how many layers the open decode step posted, if it launched one."""
        if self.thread.launched <= o.launched_before:
            return  # interrupted before it launched
        step, box = o.launched_before, self.mailbox
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()  # then the device's post count is exact
        posted = min(max(int(box.posts.item()) - step * self.L, 0), self.L)
        if posted < self.L:
            self.thread.cut(step, posted)
            box.skip_to(step + 1)

    def post(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Router hook of a posting forward: device ops only."""
        self.mailbox.post(layer, ids, weights, self._token_input if layer == 0 else None)
        self._posted += 1

    def decode_layer(self, layer: int, ids: np.ndarray, weights: np.ndarray, tokens: list[int] | None,
                     step: int = 0, lanes: list[int] | None = None) -> None:
        """One layer of decode step `step` posted, in order (control thread): what `route` and
        `experts_done` do for a one-position forward of its B rows ([B, K] `ids` and `weights`, the
        rows' input `tokens` at layer 0, on `lanes`), and `end_forward` after the last layer; the
        experts it sends to the host CPU go to the relay."""
        b = ids.shape[0]
        if layer == 0:
            self._step = (np.zeros((b, self.L, self.K), np.int16), np.zeros((b, self.L, self.K), np.float32), tokens)
            self._step_start(tokens, lanes, new_request=False)
        step_ids, step_w, toks = self._step
        step_ids[:, layer], step_w[:, layer] = ids, weights
        self._on_host.clear()
        self._twins.clear()
        if b == 1:
            self.driver.reveal(layer, step_ids[0, layer], weights=step_w[0, layer])
        else:
            self.driver.reveal(layer, step_ids[:, layer], weights=step_w[:, layer])
        if self.relay is not None:
            base = layer * self.E
            self.relay.decide(step, layer, sorted(u - base for u in self._on_host), b, ids,
                              sorted(u - base for u in self._twins))
        self._layer_end(layer)
        if layer == self.L - 1:
            self._keep(step_ids[:, None], step_w[:, None], [[t] for t in toks])

    def abandon_step(self, layers: int) -> None:
        """The decode step being read was cut short after `layers` layers (control thread, under the lock)."""
        self._step = None
        self._drop_partial_token()
        if self.relay is not None and self.relay.cache is not None:  # `_cut` synchronised the stream: no read remains
            self.relay.release_rows()
