"""The pool-size policy alone (ppserver/scheduler/elastic.py), driven with synthetic samples of a
modelled system: a trainer that takes R seqs/s, workers that each map 1/C seqs/s (a sleeping
mapper), or that share K cores (a CPU-bound one), with noise on the delivered rate."""

from __future__ import annotations

import itertools
import random
from typing import List, Optional, Tuple

import pytest

from ppserver.scheduler.elastic import Action, Elastic, Limits, PoolSample, Reason
from ppserver.scheduler.status import Side

pytestmark = pytest.mark.unit

STEP = 0.25
LIMITS = Limits(min_workers=1, max_workers=12, settle_s=1.0, window_s=2.0, hold_windows=20)


class Model:
    """Seqs delivered per second with n workers: min(R, capacity); who holds the epoch back."""

    def __init__(self, rate: float, cost: float, cores: Optional[int] = None, noise: float = 0.0, seed: int = 0):
        self.rate, self.cost, self.cores, self.noise = rate, cost, cores, noise
        self.rng = random.Random(seed)
        self.delivered = 0.0
        self.busy = 0.0

    def capacity(self, n: int) -> float:
        running = n if self.cores is None else min(n, self.cores)
        return running / self.cost

    def step(self, n: int, dt: float) -> Tuple[float, str]:
        cap = self.capacity(n)
        rate = min(self.rate, cap) * (1 + self.rng.uniform(-self.noise, self.noise))
        self.delivered += rate * dt
        # CPU-bound workers beyond the cores are busy too (sharing them), sleeping ones only as the rate asks
        busy = n if self.cores is not None and cap < self.rate else rate * self.cost
        self.busy += busy * dt
        side = Side.WORKERS if cap < self.rate * 0.98 else Side.TRAINER
        return rate, side


def drive(policy: Elastic, model: Model, seconds: float, n: int = 1, capacity: int = 12):
    """Run the policy against the model; the pool follows each decision at once. Returns the sizes
    over time and the changes (time, action, reason)."""
    t = 0.0
    sizes: List[int] = []
    changes: List[Tuple[float, Action, Optional[Reason]]] = []
    while t < seconds:
        _, side = model.step(n, STEP)
        t += STEP
        d = policy.sample(PoolSample(t, int(model.delivered), side, n, model.busy, capacity))
        if d.action is Action.ADD:
            n += 1
        elif d.action is Action.RETIRE:
            n -= 1
        if d.action is not Action.HOLD:
            changes.append((t, d.action, d.reason))
        sizes.append(n)
    return sizes, changes


def needed(rate: float, cost: float) -> int:
    return int(-(-rate * cost // 1))


@pytest.mark.parametrize("rate,cost", [(25.0, 0.1), (40.0, 0.1), (12.0, 0.5)])
def test_the_pool_grows_to_what_the_trainer_needs_and_stays(rate, cost):
    policy = Elastic(LIMITS)
    sizes, changes = drive(policy, Model(rate, cost, noise=0.05), 120.0)
    want = needed(rate, cost)
    assert abs(sizes[-1] - want) <= 1
    assert sizes[-1] >= want  # never fewer than the rate needs
    grown_by = next(i for i, n in enumerate(sizes) if n >= want) * STEP
    assert grown_by <= (want - 1) * (LIMITS.settle_s + LIMITS.window_s) + 2
    late = [c for c in changes if c[0] > grown_by + 10]
    assert late == []  # no oscillation once there
    assert all(r is Reason.WORKERS_HOLD_BACK for _, a, r in changes if a is Action.ADD)


def test_a_slower_trainer_shrinks_the_pool_with_room_to_spare():
    policy = Elastic(LIMITS)
    model = Model(40.0, 0.1, noise=0.05)
    sizes, _ = drive(policy, model, 60.0)
    assert sizes[-1] >= 4
    model.rate = 12.0  # the trainer slows down: 1.2 workers' worth
    sizes, changes = drive(policy, model, 90.0, n=sizes[-1])
    assert sizes[-1] == needed(12.0, 0.1)
    assert [r for _, a, r in changes if a is Action.RETIRE] == [Reason.TRAINER_HOLDS_BACK] * (len(changes))
    assert policy.wanted == sizes[-1]


def test_a_pool_that_is_just_enough_is_never_probed_downwards():
    """2.5 workers' worth: 3 workers, the trainer holds back, but 2 would not do: no retire."""
    policy = Elastic(LIMITS)
    sizes, changes = drive(policy, Model(25.0, 0.1, noise=0.02), 200.0)
    assert sizes[-1] == 3
    assert not [c for c in changes if c[1] is Action.RETIRE]


def test_noisy_rates_do_not_make_it_oscillate():
    for seed in range(10):
        policy = Elastic(LIMITS)
        sizes, changes = drive(policy, Model(33.0, 0.1, noise=0.15, seed=seed), 240.0)
        want = needed(33.0, 0.1)
        assert want <= sizes[-1] <= want + 1, seed
        settled = next(i for i, n in enumerate(sizes) if n >= want) * STEP
        late = [c for c in changes if c[0] > settled + 20]
        # after settling, only re-probes: an add, undone at once if it gains nothing, then quiet
        hold = LIMITS.hold_windows * (LIMITS.settle_s + LIMITS.window_s)
        assert all(a is Action.ADD for _, a, r in late[0::2]), (seed, late)
        assert all(r is Reason.NO_GAIN for _, a, r in late[1::2]), (seed, late)
        starts = [t for t, _, _ in late[0::2]]
        assert all(b - a >= hold for a, b in itertools.pairwise(starts)), (seed, late)


def test_cpu_bound_it_stops_adding_when_a_worker_gains_nothing():
    """Two cores, a mapper of 0.1 s of CPU, a trainer that wants 100/s: a third worker gains
    nothing, is retired, and is tried again only after hold_windows windows."""
    policy = Elastic(LIMITS)
    sizes, changes = drive(policy, Model(100.0, 0.1, cores=2, noise=0.02), 60.0)
    assert max(sizes) == 3
    assert sizes[-1] == 2
    assert (Action.RETIRE, Reason.NO_GAIN) in [(a, r) for _, a, r in changes]
    # within hold_windows windows of the undo, no new probe
    undo = next(t for t, a, r in changes if r is Reason.NO_GAIN)
    hold = LIMITS.hold_windows * (LIMITS.settle_s + LIMITS.window_s)
    assert [c for c in changes if undo < c[0] < undo + hold - 1] == []


def test_a_retire_that_costs_rate_is_undone():
    """Busy seconds that mislead (reported as none, as a mapper that waits outside its timing
    might): the pool retires while the trainer holds the epoch back, until a retire makes the
    workers hold it back and costs rate; that one is undone and the pool stays above it."""
    policy = Elastic(LIMITS)
    model = Model(30.0, 0.1)
    t, n, changes = 0.0, 5, []
    for _ in range(280):  # 70 s: within hold_windows windows of the undo
        _, side = model.step(n, STEP)
        t += STEP
        d = policy.sample(PoolSample(t, int(model.delivered), side, n, 0.0, 12))
        if d.action is not Action.HOLD:
            changes.append((t, d.action, d.reason))
            n += 1 if d.action is Action.ADD else -1
    assert [(a, r) for _, a, r in changes] == [
        (Action.RETIRE, Reason.TRAINER_HOLDS_BACK),  # 5 -> 4
        (Action.RETIRE, Reason.TRAINER_HOLDS_BACK),  # 4 -> 3: still enough
        (Action.RETIRE, Reason.TRAINER_HOLDS_BACK),  # 3 -> 2: the workers hold it back now
        (Action.ADD, Reason.RATE_LOST),
    ], changes
    assert n == 3


def test_bounds_and_capacity():
    lim = Limits(min_workers=2, max_workers=3, settle_s=1.0, window_s=2.0)
    policy = Elastic(lim)
    d = policy.sample(PoolSample(0.0, 0, None, 1, 0.0, 3))
    assert (d.action, d.reason) == (Action.ADD, Reason.BELOW_MIN)
    sizes, _ = drive(Elastic(lim), Model(100.0, 0.1), 60.0, n=2, capacity=3)
    assert max(sizes) == 3
    # room for only 2 here: it wants 3 (for an outside scaler) and holds
    policy = Elastic(Limits(min_workers=1, max_workers=8, settle_s=1.0, window_s=2.0))
    sizes, _ = drive(policy, Model(100.0, 0.1), 60.0, n=1, capacity=2)
    assert max(sizes) == 2
    assert policy.wanted == 3
    assert "wants 3" in policy.why


def test_no_run_holds_the_pool_as_it_is():
    policy = Elastic(LIMITS)
    for i in range(200):
        d = policy.sample(PoolSample(i * STEP, 0, None, 3, 0.0, 12))
        assert d.action is Action.HOLD
    assert policy.why == "no epoch is being delivered"
