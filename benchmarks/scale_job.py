"""A simulated training job for ``scale.py``: the rank states a node's watchdog would read from its rings.

N nodes of 8 ranks each run the same loop on one clock (a step every ``period`` seconds, each rank a
few milliseconds off the others): a DataLoader (``train.py:70``), two tensor-parallel all_gathers in the
node's own group (``model.py:41``, ``model.py:44``), the gradient all_reduce in the world group overlapping
the backward pass (``model.py:120``) and the loss all_reduce (``train.py:88``), then a step marker. A rank
is always inside some collective, as a GPU job whose collectives stay in flight is: every node's
watchdog exchanges at the fast cadence.

:meth:`SimJob.hang` makes one rank stop in its DataLoader at the start of a step: its node's other
ranks wait in the first all_gather of that step, every other rank in the gradient all_reduce, and
nothing progresses any more (heartbeats go on). The diagnosis must name that rank,
``stuck_outside_collective``.
"""
from __future__ import annotations

from dtwatch.diagnose.rank_state import Call, GroupProgress, RankState

RANKS_PER_NODE = 8
SITES = {
    "loader": {"file": "/job/train.py", "line": 70, "function": "train"},
    "tp1": {"file": "/job/model.py", "line": 41, "function": "forward"},
    "tp2": {"file": "/job/model.py", "line": 44, "function": "forward"},
    "grad": {"file": "/job/model.py", "line": 120, "function": "reduce_gradients"},
    "loss": {"file": "/job/train.py", "line": 88, "function": "train"},
    "main": {"file": "/job/train.py", "line": 95, "function": "main"},
}
# (name, group "tp"/"world", op, fingerprint, enter, leave) as fractions of a step
CALLS = [
    ("tp1", "tp", "all_gather_into_tensor", "all_gather_into_tensor[bfloat16:4096x1024]", 0.00, 0.12),
    ("tp2", "tp", "all_gather_into_tensor", "all_gather_into_tensor[bfloat16:4096x1024]", 0.12, 0.28),
    ("grad", "world", "all_reduce", "all_reduce[bfloat16:25165824]", 0.28, 0.92),
    ("loss", "world", "all_reduce", "all_reduce[float32:1]", 0.92, 1.00),
]
PER_STEP = {"tp": 2, "world": 2}
RECENT = 16


class SimJob:
    def __init__(self, nodes: int, *, period: float = 0.5, t0: float, job_id: str = "scale") -> None:
        self.nodes, self.period, self.t0, self.job_id = nodes, period, t0, job_id
        self.world = nodes * RANKS_PER_NODE
        self.world_members = list(range(self.world))
        self.hung: int | None = None
        self.hang_time = 0.0
        self.hang_step = 0

    def hang(self, rank: int, t: float) -> None:
        """From the next step after ``t``, ``rank`` stays in its DataLoader."""
        self.hang_step = int((t - self.t0) / self.period) + 1
        self.hang_time = self.t0 + self.hang_step * self.period
        self.hung = rank

    def _offset(self, rank: int) -> float:
        return (rank * 7919 % 13) * 0.0007  # a few ms between ranks, always the same ones

    def states(self, node: int, now: float) -> list[RankState]:
        return [self.rank_state(node * RANKS_PER_NODE + i, now) for i in range(RANKS_PER_NODE)]

    def _issued(self, rank: int, phase: float | None) -> list[tuple[int, bool]]:
        """The calls of the current step the rank has issued (index into CALLS, completed); ``phase`` None:
        the step the job hangs in."""
        if phase is not None:
            out = []
            for i, (_n, _g, _op, _fp, a, b) in enumerate(CALLS):
                if phase < a:
                    break
                out.append((i, phase >= b))
                if phase < b:
                    break
            return out
        if rank == self.hung:
            return []  # in its DataLoader
        if rank // RANKS_PER_NODE == (self.hung or 0) // RANKS_PER_NODE:
            return [(0, False)]  # its tensor-parallel peers wait for it in the first all_gather
        return [(0, True), (1, True), (2, False)]  # everyone else waits in the gradient all_reduce

    def rank_state(self, rank: int, now: float) -> RankState:
        node = rank // RANKS_PER_NODE
        tp_name = str(node + 1)
        tp_members = list(range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE))
        off = self._offset(rank)
        hung = self.hung is not None and now >= self.hang_time
        t = now - self.t0 - off
        step = self.hang_step if hung else int(t / self.period)
        phase = None if hung else t / self.period - step
        calls: dict[str, list[Call]] = {"tp": [], "world": []}
        open_calls: list[Call] = []
        for s in range(max(0, step - RECENT // 2 - 1), step + 1):
            issued = [(i, True) for i in range(len(CALLS))] if s < step else self._issued(rank, phase)
            for i, completed in issued:
                name, grp, op, fp, a, b = CALLS[i]
                seq = s * PER_STEP[grp] + (1 if i in (0, 2) else 2)
                c = Call(op=op, group="0" if grp == "world" else tp_name, seq=seq, site=SITES[name],
                         t_enter=self.t0 + off + (s + a) * self.period,
                         t_exit=self.t0 + off + (s + b) * self.period if completed else 0.0, fingerprint=fp,
                         user_site=SITES[name], step=s)
                calls[grp].append(c)
                if not completed:
                    open_calls.append(c)
        groups = {}
        for grp, name, members in (("world", "0", self.world_members), ("tp", tp_name, tp_members)):
            mine = calls[grp][-RECENT:]
            seq = mine[-1].seq if mine else 0
            done = [c.seq for c in mine if c.t_exit]
            groups[name] = GroupProgress(name=name, members=members, seq=seq, completed=max(done) if done else 0,
                                         py_seq=seq, cpp_seq=0, cpp_seq_time=0.0, recent=mine)
        every = [c for cs in calls.values() for c in cs]
        step_time = self.t0 + off + step * self.period
        last_activity = max([c.t_exit or c.t_enter for c in every] + [step_time])
        stuck = hung and rank == self.hung
        here: dict = SITES["loader"] if stuck else (open_calls[-1].site or {} if open_calls else SITES["main"])
        return RankState(
            rank=rank, local_rank=rank % RANKS_PER_NODE, world_size=self.world, host=f"node{node:04d}",
            pid=1000 + rank, job_id=self.job_id, start_time=self.t0 - 30.0, restart_count=0, backend="nccl",
            alive=True, proc_state="S", exit_state="running", exit_reason="", exit_time=0.0, heartbeat_time=now,
            step=step, step_time=step_time, groups=groups, open_calls=open_calls, main_site=here,
            main_top_site=here, main_site_since=self.hang_time if stuck else last_activity, main_stack=[here],
            loaders=[{"index": 0, "site": SITES["loader"], "length": 1000, "epochs": 1, "time": self.t0, "step": 0,
                      "user_site": None}],
            last_activity=last_activity,
            step_times=[self.t0 + off + s * self.period for s in range(max(1, step - 15), step + 1)],
            step_seqs=[s * PER_STEP["world"] for s in range(max(1, step - 15), step + 1)],
        )
