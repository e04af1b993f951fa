"""``DecentralizedAverager``: average tensors with whichever peers are ready (hivemind's API).

The blocking facade for training scripts and notebooks over ``AsyncAverager``
(``kit.averaging.async_averager``, re-exported here with ``RoundResult``), which runs on the
DHT's event loop (kit's one runtime loop). Steps are controlled through ``StepControl``
(``kit.averaging.control``); state sharing is ``kit.averaging.state_sharing``.

Example::

    dht = kit.dht.DHT(initial_peers=[...])
    averager = DecentralizedAverager([model_weights], dht, prefix="my_run_params",
                                     target_group_size=16, min_matchmaking_time=5)
    result = averager.step(weight=samples_since_last_round, timeout=30)  # AveragingFailed: none
    if not result.is_full:
        print("averaged over", result.report)          # exactly which parts, over whom
    with averager.get_tensors() as tensors:             # the tensors, locked against rounds
        ...
    control = averager.step(wait=False, require_trigger=True)  # find a group now...
    control.allow_allreduce()                                  # ...average when ready
    averager.shutdown()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from kit.averaging.allreduce import AveragingMode
from kit.averaging.async_averager import AsyncAverager, RoundResult
from kit.averaging.compression import CompressionBase, NoCompression
from kit.averaging.control import StepControl
from kit.averaging.matchmaking import Phase
from kit.averaging.settings import AveragerSettings, check_tensors
from kit.averaging.state_sharing import CurrentState, load_state
from kit.dht.node import DHTNode
from kit.errors import AveragingFailed, ConfigError, KitTimeout, KitUsageError
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)

T = TypeVar("T")
IGNORED_HIVEMIND_OPTIONS = frozenset({"daemon", "shutdown_timeout"})

__all__ = ["AsyncAverager", "AveragingMode", "DecentralizedAverager", "RoundResult", "StepControl"]


class DecentralizedAverager:
    """Average ``averaged_tensors`` with peers of the same ``prefix``, in rounds (hivemind's API).

    The averager runs on the DHT's event loop (kit's one runtime loop); these methods block.

    Args:
        averaged_tensors: contiguous floating-point tensors, averaged in place.
        dht: a running ``kit.dht.DHT``; the averager uses its peer.
        start: start serving at once (else call ``run_in_background``).
        prefix, target_group_size, ...: see ``AveragerSettings`` (hivemind's names and meanings).
        compression: codec of every chunk (``kit.averaging.NoCompression`` by default).
        tensor_infos: one ``CompressionInfo`` per tensor (hivemind's): the key and role that
            adaptive codecs (``RoleAdaptiveCompression``) choose by; None: keyed by index.
        robust_aggregation, clip_tau, clip_iterations: ``"centered_clip"`` makes each peer
            reduce its part with CenteredClip instead of the weighted mean, so that a byzantine
            sender cannot drag the average (``kit.averaging.robust``: what it does not cover).
        allow_state_sharing: serve ``get_current_state()`` to peers that call
            ``load_state_from_peers`` (default: unless client-mode or auxiliary).
        declare_state_period: seconds between re-declarations as a state donor in the DHT.

    Raises:
        ConfigError: bad settings or tensors.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: Any,
        *,
        start: bool = True,
        prefix: str,
        compression: CompressionBase | None = None,
        allow_state_sharing: bool | None = None,
        state_compression: CompressionBase | None = None,
        averaging_alpha: float = 1.0,
        **settings: Any,
    ) -> None:
        self._tensors = check_tensors(averaged_tensors)
        self._dht = dht
        for name in IGNORED_HIVEMIND_OPTIONS & set(settings):
            logger.debug("DecentralizedAverager ignores hivemind's %s=%r", name, settings.pop(name))
        if "sender_timeout" in settings:  # hivemind's other name for it
            settings["next_chunk_timeout"] = settings.pop("sender_timeout")
        unsupported = set()
        if averaging_alpha != 1.0:
            unsupported.add("averaging_alpha")
        if state_compression is not None and not isinstance(state_compression, NoCompression):
            unsupported.add("state_compression")
        if unsupported:
            raise ConfigError(
                f"kit's averager does not support {', '.join(sorted(unsupported))} - help: drop "
                "them (averaging_alpha is always 1; the state travels uncompressed)"
            )
        self.settings = AveragerSettings(
            prefix=prefix, compression=compression or NoCompression(), **settings
        )
        client_mode = self.settings.client_mode
        if client_mode is None and dht is not None and hasattr(dht, "client_mode"):
            client_mode = _cannot_accept(dht) if dht.is_alive() else None
        self._client_mode = bool(client_mode)
        if allow_state_sharing is None:
            allow_state_sharing = not self._client_mode and not self.settings.auxiliary
        self._allow_state_sharing = False
        self._state_sharing_priority = 0.0
        self._lock = threading.Lock()
        self._core: AsyncAverager | None = None
        self.allow_state_sharing = allow_state_sharing
        self.last_step: StepControl | None = None  # the latest step() (hivemind's scheduled steps)
        if start:
            self.run_in_background()

    def _submit(self, make: Callable[[DHTNode], Awaitable[T]]) -> concurrent.futures.Future[T]:
        async def run(dht: Any, node: DHTNode) -> T:
            return await make(node)

        future: concurrent.futures.Future[T] = self._dht.run_coroutine(run, return_future=True)
        return future

    def _wait(self, future: concurrent.futures.Future[T], timeout: float | None) -> T:
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KitTimeout(f"the averager did not answer within {timeout} s") from None

    def run_in_background(self, await_ready: bool = True, timeout: float | None = 30.0) -> None:
        """Start serving (hivemind's name)."""
        if self._core is None:
            self._core = self._wait(
                self._submit(
                    lambda node: AsyncAverager.create(
                        self._tensors,
                        node,
                        self.settings,
                        self._lock,
                        get_state=self.get_current_state,
                        share_state=self._allow_state_sharing,
                        state_priority=self._state_sharing_priority,
                    )
                ),
                timeout,
            )
            self._client_mode = self._core.client_mode
            if self._client_mode:  # found out only now (the DHT's peer chose client mode)
                self._allow_state_sharing = False

    def is_alive(self) -> bool:
        """Serving (started, not shut down, its DHT running)."""
        return self._core is not None and self._dht.is_alive()

    @property
    def peer_id(self) -> PeerID:
        peer_id: PeerID = self._dht.peer_id
        return peer_id

    @property
    def mode(self) -> AveragingMode:
        """NODE, CLIENT (aggregates nothing: see ``client_mode``) or AUX (aggregates, sends
        nothing)."""
        if self._client_mode:
            return AveragingMode.CLIENT
        return AveragingMode.AUX if self.settings.auxiliary else AveragingMode.NODE

    @property
    def client_mode(self) -> bool:
        """Aggregates nothing and never leads (hivemind's meaning): asked so, or the DHT's peer
        cannot accept connections (``PeerAPI.can_accept``; a client-mode peer behind a NAT it
        can punch through aggregates)."""
        return self._client_mode

    # --- steps --------------------------------------------------------------------------------

    def step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        wait: bool = True,
    ) -> RoundResult | StepControl:
        """Find a group and average with it once (hivemind's ``step``).

        Args:
            gather: not supported (hivemind's all-gather of metadata); must be None.
            scheduled_time: DHT time at which the round should begin (default: now +
                min_matchmaking_time): a leader waits for followers until then.
            weight: this peer's weight (e.g. samples since the last round); default 1.
            timeout: seconds to look for a group (default: until scheduled_time, then 10 x
                request_timeout); the all-reduce is bounded by allreduce_timeout and the
                per-chunk timeouts.
            allow_retries: after a failed search or round, look again until the timeout.
            require_trigger: find the group, then wait for ``control.allow_allreduce()``.
            wait: block until done; False returns the ``StepControl`` (a Future) at once.

        Returns:
            The ``RoundResult`` (iterable over the group's peer ids), or its StepControl.

        Raises:
            AveragingFailed: no group formed in time, or every round failed (nothing changed).
            KitUsageError: ``wait=True`` with ``require_trigger=True`` (nobody could trigger).
        """
        if gather is not None:
            raise ConfigError(
                "gather= (hivemind's all-gather) is not supported - help: publish such metadata "
                "in the DHT, e.g. under a subkey of your own key"
            )
        if wait and require_trigger:
            raise KitUsageError(
                "a step that waits for its trigger cannot block the caller - help: use "
                "step(wait=False, require_trigger=True), then control.allow_allreduce()"
            )
        core = self._require()
        control = core.make_control(
            weight=weight,
            timeout=timeout,
            scheduled_time=scheduled_time,
            allow_retries=allow_retries,
        )
        if not require_trigger:
            control.allow_allreduce()
        future = self._submit(lambda node: core.run_step(control))
        future.add_done_callback(lambda done: _settle(control, done))
        self.last_step = control
        if not wait:
            return control
        bound = control.get_timeout() + 2 * (self.settings.allreduce_timeout or 600.0) + 30.0
        try:
            result: RoundResult = control.result(bound)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KitTimeout(f"the averaging step did not end within {bound:.0f} s") from None
        return result

    def get_group_bits(self) -> str:
        """The group key suffix of the next rounds (hivemind's name)."""
        return self._require().matchmaking.group_bits

    def set_target_group_size(self, size: int | None) -> None:
        """Begin the next rounds as soon as ``size`` peers joined (None: wait min_matchmaking_time).

        The collaborative optimizer sets it to the number of peers it expects at its epoch, so a
        round does not idle for the whole matchmaking time once everyone is there. The
        ``target_group_size`` this averager was created with stays the largest group: more
        peers than that split into several groups.
        """
        cap = self.settings.target_group_size
        if cap is not None:
            size = cap if size is None else min(size, cap)
        matchmaking = self._require().matchmaking
        matchmaking.settings = dataclasses.replace(matchmaking.settings, target_group_size=size)

    def set_deadlines(self, min_matchmaking_time: float, allreduce_timeout: float | None) -> None:
        """Change the matchmaking time and round timeout of the next rounds (``"auto"``
        deadlines of ``kit.Optimizer``: ``kit.averaging.deadlines``)."""
        core = self._require()
        self.settings = dataclasses.replace(
            self.settings,
            min_matchmaking_time=min_matchmaking_time,
            allreduce_timeout=allreduce_timeout,
        )
        core.settings = dataclasses.replace(
            core.settings,
            min_matchmaking_time=min_matchmaking_time,
            allreduce_timeout=allreduce_timeout,
        )
        core.matchmaking.settings = dataclasses.replace(
            core.matchmaking.settings, min_matchmaking_time=min_matchmaking_time
        )

    def set_shards(self, shards: int) -> None:
        """Declare first under one of ``shards`` shard keys of the group key (1: none); their
        short chunks meet in a pool under the group key (``kit.averaging.grid.shards_for``)."""
        if shards < 1:
            raise ConfigError(f"shards={shards} - help: use 1 (no sharding) or more")
        self._require().matchmaking.shards = shards

    def set_group_bits(self, group_bits: str) -> None:
        """Only averagers with the same group bits average together (e.g. the same epoch)."""
        if set(group_bits) - {"0", "1"}:
            raise ConfigError("group bits hold only 0 and 1 - help: e.g. format(epoch, '020b')")
        self._require().matchmaking.group_bits = group_bits

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, locked: no round reads or writes them inside this block."""
        with self._lock:
            yield self._tensors

    def statistics(self) -> dict[str, Any]:
        return self._require().statistics()

    @property
    def bandwidth(self) -> float | None:
        """Measured (or given) bandwidth in bytes per second, used for load balancing."""
        return self._require().bandwidth

    @property
    def is_looking_for_group(self) -> bool:
        """A round is still forming its group (to give it up, :meth:`give_up_search`: the
        group may begin between reading this and cancelling)."""
        core = self._core
        return core is not None and core.matchmaking.phase in (
            Phase.LOOKING,
            Phase.JOINING,
            Phase.LEADING,
        )

    def give_up_search(self, control: StepControl, timeout: float = 5.0) -> bool:
        """Cancel ``control``'s step if nobody counts on this peer yet (True: cancelled).

        Unlike reading :attr:`is_looking_for_group` and then calling ``control.cancel()``, the
        check and the cancellation happen together on kit's loop: a group cannot begin with
        this peer in between (it then announced a group it left: its members waited for its
        parts and averaged without them). See ``MatchmakingDriver.give_up_if_unpromised``.
        """
        core = self._require()

        async def give_up(node: DHTNode) -> bool:
            if control.done() or control.began_allreduce:
                return False
            if not core.matchmaking.give_up_if_unpromised("the caller gave up the search"):
                return False
            return control.cancel()

        try:
            return self._wait(self._submit(give_up), timeout)
        except KitTimeout:
            return False

    # --- state sharing ------------------------------------------------------------------------

    @property
    def allow_state_sharing(self) -> bool:
        """Serve ``get_current_state()`` to peers that load the state (hivemind's name)."""
        return self._allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if value and self._client_mode:
            raise ConfigError(
                "a client-mode averager cannot share its state (nobody can connect to it) - "
                "help: leave allow_state_sharing off on client-mode peers"
            )
        self._allow_state_sharing = bool(value)
        self._configure_sharing(allow=bool(value))

    @property
    def state_sharing_priority(self) -> float:
        """Peers download the state from the donor with the highest priority first (e.g. its epoch)."""
        return self._state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        if not (isinstance(value, int | float) and math.isfinite(value)):
            raise ConfigError(f"state_sharing_priority={value!r} must be a finite number")
        if value and self._client_mode:
            raise ConfigError(
                "a client-mode averager shares no state, so its priority is unused - help: "
                "set it on peers that accept connections"
            )
        self._state_sharing_priority = float(value)
        self._configure_sharing(priority=float(value))

    def _configure_sharing(self, **changes: Any) -> None:
        core = self._core
        if core is not None and core.sharing is not None:
            core.sharing.configure(**changes)

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        """What peers download from this one: ``(metadata, tensors)``. Override it to share more.

        ``metadata`` must be plain msgpack data (dicts, lists, str, bytes, numbers, None): kit
        never pickles what travels. It runs in a worker thread when a peer asks. By default:
        the group bits and a copy of the averaged tensors, taken under their lock.
        """
        with self.get_tensors() as tensors:
            return {"group_key": self.get_group_bits()}, [t.detach().clone() for t in tensors]

    def load_state_from_peers(
        self, wait: bool = True, timeout: float | None = None
    ) -> CurrentState | None | concurrent.futures.Future[CurrentState | None]:
        """Download ``(metadata, tensors)`` from the donor with the highest priority that serves
        it (hivemind's name); None if no other peer shares its state.

        Args:
            wait: block; False returns a Future at once.
            timeout: the longest the whole download may take (None: as long as each donor
                answers within max(request_timeout, next_chunk_timeout) per message).
        """
        core = self._require()
        answer = max(self.settings.request_timeout, self.settings.sender_timeout)

        async def download(node: DHTNode) -> CurrentState | None:
            deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
            return await load_state(
                core.node, self.settings.prefix, answer_timeout=answer, deadline=deadline
            )

        future = self._submit(download)
        if not wait:
            return future
        return self._wait(future, None if timeout is None else timeout + answer)

    # --- lifecycle ----------------------------------------------------------------------------

    def _require(self) -> AsyncAverager:
        if self._core is None:
            raise KitUsageError(
                "the averager is not running - help: create it with start=True, or call "
                "run_in_background()"
            )
        return self._core

    def shutdown(self) -> None:
        """Stop the averager (safe to call twice)."""
        core, self._core = self._core, None
        if core is not None and self._dht.is_alive():
            self._wait(self._submit(lambda node: core.shutdown()), 30.0)

    def __enter__(self) -> DecentralizedAverager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _cannot_accept(dht: Any) -> bool:
    """Whether others cannot connect to the DHT's peer directly (``PeerAPI.can_accept``): what
    makes an averager a client when ``client_mode=None``. Before it runs, the averager only
    guesses (for ``allow_state_sharing``'s default); ``run_in_background`` then asks its peer."""
    peer = getattr(getattr(dht, "node", None), "peer", None)
    can_accept = getattr(peer, "can_accept", None)
    return not can_accept if isinstance(can_accept, bool) else bool(dht.client_mode)


def _settle(control: StepControl, done: concurrent.futures.Future[Any]) -> None:
    """The step's coroutine ended: make sure its control has an outcome (it sets one itself,
    unless the coroutine never ran, e.g. the runtime stopped first)."""
    if not control.done():
        error = None if done.cancelled() else done.exception()
        control.finish(error=AveragingFailed(f"the averaging step did not run: {error!r}"))
