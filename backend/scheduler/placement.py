"""Placement: turn a task's request into named groups with workers, at allocation time.

A request item names a group (`{"name", "workers"}`) or asks for a device type
(`{"device_type", "workers", "placement", "labels"}`). The two placement
policies of the source design (heterogeneous parallel computing patent family,
first-level dispatch to resource groups):

- `uniform`: spread the workers as evenly as possible over every eligible
  group (active, that device type, the labels) with free workers;
- `resource_state`: largest free group first, so a task spans as few groups
  as the current free capacity allows.

On a restart (`previous` given) a named group that cannot take its workers now
is replaced by a compatible one: active, same device type, enough free workers (unless
the task's `on_group_loss` is `wait`). With `shrink`, a restart that fits nowhere in full
goes on with the groups of the last attempt that can take their workers again
(:func:`survivors`); at its next epoch end with room it takes the whole request again
(:mod:`backend.scheduler.regrow`, through :func:`plan`).
"""

from typing import TypeVar

from backend.scheduler.capacity import GroupFree
from contracts.plan import GroupPlan, check_local_batch
from contracts.task_spec import RequestItem, TaskSpec

Plan = list[GroupPlan]
Key = TypeVar("Key", str, int)  # a group's name, or an agent's id


def plan(
    request: list[RequestItem],
    free: dict[str, GroupFree],
    previous: Plan | None = None,
    *,
    migrate: bool = True,
) -> Plan | None:
    """Named groups with workers for `request` given `free`, or None if it does not fit now.

    Every group appears once; named items are placed first, then device items
    over the groups left. `migrate` False: a restart's named item waits for its own group.
    """
    remaining = {name: g.free for name, g in free.items()}
    placed: dict[str, int] = {}
    named = [item for item in request if item.name]
    # A shrunk attempt ran on fewer groups than the request has items: its positions no
    # longer line up with the items, so each named item tries its own group again.
    ran_on = previous if previous is not None and len(previous) >= len(request) else None
    for position, item in enumerate(named + [i for i in request if not i.name]):
        shares = (
            _named(item, position, free, remaining, placed, previous if migrate else None, ran_on)
            if item.name
            else _by_device(item, free, remaining, placed)
        )
        if shares is None:
            return None
        for name, workers in shares.items():
            placed[name] = workers
            remaining[name] -= workers
    return [
        GroupPlan.model_validate({"name": n, "device_type": free[n].device_type, "workers": w})
        for n, w in placed.items()
    ]


def _named(
    item: RequestItem,
    position: int,
    free: dict[str, GroupFree],
    remaining: dict[str, int],
    placed: dict[str, int],
    previous: Plan | None,
    ran_on: Plan | None = None,
) -> dict[str, int] | None:
    """A named item's group: where the last attempt ran (`ran_on`, named items first), else
    its own; when that has no room, a compatible one if `previous` allows moving."""
    workers = item.workers
    name = str(item.name)
    if ran_on is not None and position < len(ran_on):
        name = ran_on[position].name
    if name in free and name not in placed and remaining[name] >= workers:
        return {name: workers}
    if previous is None or name not in free:
        return None
    wanted = free[name]
    compatible = [
        g
        for g in free.values()
        if g.device_type == wanted.device_type
        and g.name not in placed
        and remaining[g.name] >= workers
    ]
    if not compatible:
        return None
    best = max(compatible, key=lambda g: (remaining[g.name], g.name == item.name, g.name))
    return {best.name: workers}


def survivors(
    previous: Plan, free: dict[str, GroupFree], spec: TaskSpec | None = None
) -> Plan | None:
    """`shrink`: the groups of the last attempt that can take their workers again now, in
    their order, when some but not all can (None otherwise: nothing to shrink onto, or
    nothing lost, or, given the task's `spec`, groups whose max_local_batch cannot hold its
    global batch, where the engine would refuse the shrunk task)."""
    kept = [g for g in previous if g.name in free and free[g.name].free >= g.workers]
    if not kept or len(kept) == len(previous):
        return None
    if spec is not None and spec.global_batch_size is not None:
        caps = [(g.name, g.workers, spec.max_local_batch_of(g)) for g in kept]
        try:
            check_local_batch(caps, spec.global_batch_size, spec.split_policy)
        except ValueError:
            return None
    return kept


def eligible(
    item: RequestItem, free: dict[str, GroupFree], remaining: dict[str, int], placed: dict[str, int]
) -> list[GroupFree]:
    """Groups a device item may use: its device type and labels, not yet used, free room."""
    return sorted(
        (
            g
            for g in free.values()
            if g.device_type == item.device_type
            and g.matches(item.labels)
            and g.name not in placed
            and remaining[g.name] > 0
        ),
        key=lambda g: g.name,
    )


def _by_device(
    item: RequestItem, free: dict[str, GroupFree], remaining: dict[str, int], placed: dict[str, int]
) -> dict[str, int] | None:
    groups = eligible(item, free, remaining, placed)
    workers = item.workers
    room = {g.name: remaining[g.name] for g in groups}
    if sum(room.values()) < workers:
        return None
    if item.placement == "uniform":
        return uniform(workers, room)
    return largest_first(workers, room)


def uniform(workers: int, room: dict[str, int]) -> dict[str, int]:
    """Spread `workers` evenly over the groups of `room` (name -> free workers).

    Water-filling: one worker per group per round, groups with the most room
    first, skipping full groups; with fewer workers than groups the roomiest
    groups get one each. Assumes sum(room) >= workers.
    """
    shares = dict.fromkeys(room, 0)
    order = sorted(room, key=lambda n: (-room[n], n))
    left = workers
    while left:
        for name in order:
            if left and shares[name] < room[name]:
                shares[name] += 1
                left -= 1
    return {n: w for n, w in shares.items() if w}


def largest_first(workers: int, room: dict[Key, int]) -> dict[Key, int]:
    """Fill the group (or agent) with the most free workers first, then the next (resource
    state; ties by name or id). Assumes sum(room) >= workers."""
    shares: dict[Key, int] = {}
    left = workers
    for name in sorted(room, key=lambda n: (-room[n], n)):
        if left == 0:
            break
        take = min(left, room[name])
        shares[name] = take
        left -= take
    return shares


def parts(workers: int, group: GroupFree) -> list[tuple[int | None, int]]:
    """A group's `workers` split into parts across its serving agents: (agent id, workers),
    the agent with the most free workers first, never more than an agent has free.

    A group read without its agents (`group.agents` None) is one unbound part (None, workers),
    booked for an agent when it is dispatched.

    Raises:
        ValueError: the agents have fewer free workers than `workers` together (capacity
            bounds a group's free workers by theirs, so placement never asks this).
    """
    if group.agents is None:
        return [(None, workers)]
    room = {a.id: a.free for a in group.agents if a.free}
    if sum(room.values()) < workers:
        raise ValueError(f"group '{group.name}' has {sum(room.values())} free workers < {workers}")
    return [(agent, n) for agent, n in largest_first(workers, room).items()]
