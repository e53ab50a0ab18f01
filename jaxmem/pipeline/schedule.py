"""Pipeline schedules: each stage's order of forward (F) and backward (B) micro-batch passes, one global
issue order that respects the data flow, and what each order costs (bubble, micro-batches in flight)."""
from __future__ import annotations

import dataclasses

FORWARD, BACKWARD = "F", "B"


def stage_orders(kind: str, pp: int, micro: int) -> list[list[tuple[str, int]]]:
    """Per stage, its passes in order. gpipe: every forward, then every backward (latest first). 1f1b:
    pp - s - 1 warm-up forwards, then one forward and one backward alternating, then the remaining
    backwards, so stage s never holds more than pp - s micro-batches' activations."""
    orders = []
    for s in range(pp):
        if kind == "gpipe":
            ops = [(FORWARD, m) for m in range(micro)] + [(BACKWARD, m) for m in reversed(range(micro))]
        elif kind == "1f1b":
            warm = min(pp - s - 1, micro)
            ops = [(FORWARD, m) for m in range(warm)]
            for i in range(micro - warm):
                ops += [(FORWARD, warm + i), (BACKWARD, i)]
            ops += [(BACKWARD, m) for m in range(micro - warm, micro)]
        else:
            raise ValueError(f"parallel.pp_schedule: {kind!r} is not gpipe or 1f1b")
        orders.append(ops)
    return orders


@dataclasses.dataclass(frozen=True)
class Schedule:
    kind: str
    pp: int
    micro: int
    order: tuple[tuple[int, str, int], ...]  # (stage, F/B, micro-batch) in the order the driver issues them
    in_flight: tuple[int, ...]  # per stage: the most micro-batches whose forward ran and backward has not
    ticks: int  # time slots of the simulated run (a backward counts two, a forward one)

    @property
    def bubble(self) -> float:
        """Idle fraction of each stage's time in the simulated run: 1 - 3 x micro / ticks (with a backward
        twice a forward; (pp - 1) / (micro + pp - 1) for both schedules)."""
        return 1.0 - 3 * self.micro / self.ticks


def build(kind: str, pp: int, micro: int) -> Schedule:
    """Simulates the stages running their orders in parallel (a pass starts once its input exists: the
    forward of the stage before, the backward of the stage after) and issues the passes in start order."""
    orders = stage_orders(kind, pp, micro)
    cost = {FORWARD: 1, BACKWARD: 2}
    finished: dict[tuple[int, str, int], int] = {}
    free_at, nxt, order = [0] * pp, [0] * pp, []
    held, most = [0] * pp, [0] * pp
    while len(order) < 2 * pp * micro:
        ready = []
        for s in range(pp):
            if nxt[s] == len(orders[s]):
                continue
            op, m = orders[s][nxt[s]]
            dep = (s - 1, FORWARD, m) if op == FORWARD and s > 0 else \
                  (s + 1, BACKWARD, m) if op == BACKWARD and s < pp - 1 else None
            if dep is not None and dep not in finished:
                continue
            ready.append((max(free_at[s], finished.get(dep, 0)), s, op, m))
        start, s, op, m = min(ready)
        finished[(s, op, m)] = free_at[s] = start + cost[op]
        nxt[s] += 1
        held[s] += 1 if op == FORWARD else -1
        most[s] = max(most[s], held[s])
        order.append((s, op, m))
    return Schedule(kind, pp, micro, tuple(order), tuple(most), max(free_at))
