"""A model-based test of the grouping state: one member, once, whatever the interleaving.

Hypothesis's stateful testing drives engines' :class:`GroupResolver` objects (two data-parallel
engines under one front end, and an independent replica) with random interleavings of arrivals of
every kind of group, leaves, preemptions (resumed, or re-admitted after the parked member was
dropped), LRU pressure (``max_open_groups`` = 2), clock ticks past auto-group TTLs and restarts of a
replica (a new front end: a new instance salt). The invariant, checked after every step: no two
requests hold the same member — the same design, size, seed, order and member index, i.e. the same
uniforms — unless the event that allowed it was counted (``GroupStats``) and logged. The only such
events are an auto group closed (TTL or eviction: a seeded repeat starts the same group again, as
vLLM's seeded requests repeat) and a forgotten children counter forgotten again (``children_lost``).

Explicit members (``qmc_index`` given, ``children`` = 1) are the caller's to keep apart and are not
drawn here; explicit members with ``n > 1`` children are. The children of one ``n > 1`` request reach
any engine of their replica, one by one (vLLM's data-parallel balancer routes each child on its own),
in any order; each carries its place in the request where the front end marked it (``child``), and
none where it could not (a vLLM whose fan-out it cannot see), so both ways are drawn.
"""

import dataclasses
import itertools

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from qmc_sampler.counter_rng import Purpose, counter_seed
from qmc_sampler.members import AUTO, EXPLICIT, PER_REQUEST, EngineSalt, GroupArgs, GroupResolver, groups

TTL = 10.0
ENGINES = (("A", 0), ("A", 1), ("B", 0))  # (replica, data-parallel rank): A has two engines


class _Said:
    """Stands in for the grouping module's logger while a machine runs: what the plugin says is
    recorded at the source, whatever the process's logging setup (levels, ``logging.disable``,
    vLLM's dictConfig) did to the real logger earlier in the same test worker."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def warning(self, message: str, *args: object) -> None:
        self.messages.append(message % args if args else message)

    info = debug = error = warning


class GroupingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.counter = itertools.count(1)
        self.now = 0.0
        self.salts = {"A": 11, "B": 11}  # replicas started alike: the same salt until a restart draws another
        self.salts = {name: self._new_salt() for name in self.salts}
        self.resolvers = {engine: self._resolver(engine) for engine in ENGINES}
        self.retired: list[GroupResolver] = []  # resolvers of restarted replicas (their counts stay)
        self.records: list[tuple[int, tuple, str, tuple | None, int]] = []  # (request, identity, kind, key, step)
        self.live: list[tuple] = []  # (request id, engine, request, placement, prompt)
        # children not arrived yet: (replica, request, their places in it, marked by the front end)
        self.pending: list[tuple[str, GroupArgs, list[int], bool]] = []
        self.closed: list[tuple[tuple, tuple, int]] = []  # (engine, auto key, step)
        self.next_index = 0  # explicit groups with children: the next free range of indices
        self.step = 0
        self.log = _Said()
        self._logger = groups.logger
        groups.logger = self.log

    def teardown(self) -> None:
        groups.logger = self._logger

    def _new_salt(self) -> int:
        # A counter-based stand-in for os.urandom: distinct per engine client, reproducible per run.
        return counter_seed(2026, Purpose.FRONT_END_SEED, 0, next(self.counter))

    def _resolver(self, engine: tuple) -> GroupResolver:
        resolver = GroupResolver(salt=EngineSalt(0, engine[1]), max_open_groups=2, clock=lambda: self.now)
        # A close happens inside the next placement: after the last one recorded.
        resolver.on_close = lambda key, why, engine=engine: self.closed.append((engine, key, self.step + 0.5))
        return resolver

    def _place(self, engine: tuple, request: GroupArgs, request_id: int, prompt=(1, 2, 3), again=False) -> None:
        resolver = self.resolvers[engine]
        key = resolver.key(request, list(prompt))
        placement = resolver.place(request, key, again=again)
        resolver.joined(placement)
        spec = placement.spec
        identity = (spec.method, spec.n, spec.seed, spec.order, placement.member)
        self.step += 1
        self.records.append((request_id, identity, request.kind, (engine, key) if request.kind == AUTO else None,
                             self.step))  # fmt: skip
        self.live.append((request_id, engine, request, placement, prompt))

    # ---- arrivals ------------------------------------------------------------
    @rule(engine=st.sampled_from(ENGINES), group=st.integers(0, 3))
    def explicit_member_by_arrival(self, engine, group):
        # qmc_group "g<k>" with qmc_seed and qmc_n = 8, no qmc_index (as on vllm serve, or a load balancer)
        seed = 500 + group
        request = GroupArgs(EXPLICIT, "lattice", "id", seed, 8, f"user:g{group}:lattice:{seed}",
                             tag=f"t{next(self.counter)}", salt=self.salts[engine[0]])  # fmt: skip
        self._place(engine, request, next(self.counter))

    @rule(replica=st.sampled_from(["A", "B"]), n=st.integers(2, 4), explicit=st.booleans())
    def request_with_marked_children(self, replica, n, explicit):
        # The front end marks each child with its place in its request as vLLM fans the request out.
        self.request_with_children(replica, n, explicit, marked=True)

    @rule(replica=st.sampled_from(["A", "B"]), n=st.integers(2, 4), explicit=st.booleans())
    def request_with_unmarked_children(self, replica, n, explicit):
        # A front end that cannot see vLLM's fan-out: the engines number the children they get.
        self.request_with_children(replica, n, explicit, marked=False)

    def request_with_children(self, replica, n, explicit, marked):
        # n > 1: a request group (fresh seed from the front end), or qmc_index + n children of group "h"
        salt = self.salts[replica]
        if explicit:
            request = GroupArgs(EXPLICIT, "lattice", "id", 7, 4096, "user:h:lattice:7", self.next_index,
                                 children=n, tag=f"t{next(self.counter)}", salt=salt)  # fmt: skip
            self.next_index += n
        else:
            fresh = counter_seed(salt, Purpose.FRONT_END_SEED, 1, next(self.counter))
            request = GroupArgs(PER_REQUEST, "lattice", "id", None, n, f"req:{next(self.counter)}", fresh_seed=fresh,
                                 salt=salt)  # fmt: skip
        self.pending.append((replica, request, list(range(n)), marked))

    @precondition(lambda self: self.pending)
    @rule(which=st.integers(0, 7), child=st.integers(0, 3), rank=st.integers(0, 1))
    def child_arrives(self, which, child, rank):
        # Any child, on any engine of its replica: vLLM's balancer picks one per child (A has two).
        replica, request, left, marked = self.pending.pop(which % len(self.pending))
        engines = [e for e in ENGINES if e[0] == replica]
        place = left.pop(child % len(left))
        self._place(engines[rank % len(engines)], dataclasses.replace(request, child=place) if marked else request,
                    next(self.counter))  # fmt: skip
        if left:
            self.pending.append((replica, request, left, marked))

    @rule(engine=st.sampled_from(ENGINES), prompt=st.integers(0, 2), seeded=st.booleans())
    def auto_repeat(self, engine, prompt, seeded):
        # lm-eval's repeats: seed 1234 on every one; or unseeded repeats (a fresh seed each, from the front end)
        salt = self.salts[engine[0]]
        fresh = None if seeded else counter_seed(salt, Purpose.FRONT_END_SEED, 2, next(self.counter))
        request = GroupArgs(AUTO, "lattice", "id", 1234 if seeded else None, 0, params_key="p", arrival=self.now,
                             ttl=TTL, fresh_seed=fresh, salt=salt)  # fmt: skip
        self._place(engine, request, next(self.counter), prompt=(prompt, 9))

    # ---- the batch -----------------------------------------------------------
    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 15))
    def leave(self, which):
        _, engine, _, placement, _ = self.live.pop(which % len(self.live))
        self.resolvers[engine].left(placement)

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 15), dropped=st.booleans())
    def preempted_and_back(self, which, dropped):
        request_id, engine, request, placement, prompt = self.live.pop(which % len(self.live))
        resolver = self.resolvers[engine]
        resolver.left(placement)
        if not dropped:  # its parked member is found again: the same placement
            resolver.joined(placement)
            self.live.append((request_id, engine, request, placement, prompt))
            return
        self._place(engine, request, request_id, prompt, again=True)  # dropped while parked: admitted again

    @rule(dt=st.sampled_from([1.0, 4.0, 25.0]))
    def tick(self, dt):
        self.now += dt

    @rule(replica=st.sampled_from(["A", "B"]))
    def restart(self, replica):
        # The whole replica: a new front end (a new instance salt) and new engines; its requests are gone.
        self.salts[replica] = self._new_salt()
        for engine in ENGINES:
            if engine[0] == replica:
                self.retired.append(self.resolvers[engine])
                self.resolvers[engine] = self._resolver(engine)
        self.live = [x for x in self.live if x[1][0] != replica]
        self.pending = [x for x in self.pending if x[0] != replica]

    # ---- the invariant -------------------------------------------------------
    @invariant()
    def one_member_once(self):
        resolvers = [*self.resolvers.values(), *self.retired]
        lost = sum(getattr(r.stats, "children_lost", 0) for r in resolvers)  # (0 where not counted)
        seen: dict[tuple, tuple] = {}
        for request_id, identity, kind, key, step in self.records:
            other = seen.setdefault(identity, (request_id, kind, key, step))
            if other[0] == request_id:
                continue
            if kind == AUTO and other[1] == AUTO and key == other[2]:
                # A seeded auto group started again: only after it was closed, counted and logged.
                closes = [c for c in self.closed if (c[0], c[1]) == key and other[3] < c[2] <= step]
                counted = sum(r.stats.auto_expired + r.stats.auto_evicted for r in resolvers)
                said = any("auto group expired" in m or "idle auto group" in m for m in self.log.messages)
                assert closes and counted and said, (identity, other, request_id)
                seen[identity] = (request_id, kind, key, step)
                continue
            assert lost and any("repeat a member index" in m for m in self.log.messages), (
                f"requests {other[0]} ({other[1]}) and {request_id} ({kind}) hold the same member {identity}"
            )


TestGrouping = GroupingMachine.TestCase
TestGrouping.settings = settings(
    derandomize=True, max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
