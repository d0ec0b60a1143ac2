"""What a diagnosis produces: kinds, severities and typed findings (JSON-serialisable)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

from dtwatch.diagnose.rank_state import Call

STALL, WARNING = "stall", "warning"


class Kind(str, Enum):
    """What went wrong. A ``str`` so findings compare and serialise as plain strings."""

    RANK_CONDITIONAL = "rank_conditional"  # a collective only some ranks call (or one rank skipped)
    UNEVEN_ITERATIONS = "uneven_iterations"  # some ranks left the loop while others are still in it
    STUCK_OUTSIDE = "stuck_outside_collective"  # a live rank is not in any collective; others wait
    RANK_EXITED = "rank_exited"  # a rank ended while others need it
    MISMATCH = "mismatch"  # same group, seq and line; different op, dtype or shape
    DESYNC = "desync"  # the ranks issued the same collectives in a different order
    UNRESPONSIVE = "unresponsive"  # alive, but not running Python (GIL held, stopped)
    STRAGGLER = "straggler"  # progressing, one rank consistently last
    STALLED_COLLECTIVE = "stalled_collective"  # everyone is in the same collective; it does not complete
    # Setup mistakes that never hang (warnings, dtwatch.diagnose.setup)
    NOT_DISTRIBUTED = "not_distributed"  # WORLD_SIZE > 1 but no process group: every rank trains alone
    SAME_DEVICE = "same_device"  # two local ranks use the same GPU
    SAME_DATA = "same_data"  # ranks train on the same data (sampler not distributed, identical first batches)
    SAME_SHUFFLE = "same_shuffle"  # DistributedSampler(shuffle=True) whose epoch never changes
    CONFIG_DIVERGENCE = "config_divergence"  # ranks disagree on facts they should share (torch, model)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


KINDS = tuple(k.value for k in Kind)


@dataclass
class Finding:
    kind: str
    severity: str
    ranks: list[int]  # the culprits
    summary: str
    op: str | None = None
    group: str | None = None
    seq: int | None = None
    site: dict | None = None  # the root-cause line: the culprit's own line (file, line, function, source)
    waiting_ranks: list[int] = field(default_factory=list)
    waiting_op: str | None = None
    waiting_group: str | None = None
    waiting_seq: int | None = None
    waiting_site: dict | None = None
    onset: float = 0.0
    detected: float = 0.0
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = str(self.kind)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def key(self) -> tuple:
        return (str(self.kind), tuple(self.ranks), self.group, self.seq)


@dataclass
class Position:
    """Where one rank is, for the purpose of comparing ranks."""

    rank: int
    state: str  # "gone" | "unresponsive" | "blocked" | "outside"
    call: Call | None = None
    site: dict | None = None

    @property
    def issued(self) -> Call:
        """The call of a rank that issued one ("blocked" positions always carry it)."""
        if self.call is None:
            raise ValueError(f"rank {self.rank} is {self.state}, with no call")
        return self.call

    def key(self) -> tuple:
        c = self.call
        if c is None:
            return (self.state,)
        return (c.group, c.seq, c.op, c.site_key, c.fingerprint)


# Exceptions that are the consequence of a peer's death, not a cause (gloo and NCCL wording).
PEER_ERRORS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "read error", "write error",
    "communicator was aborted", "nccl communicator", "socket closed", "connection refused",
    "timed out", "timeout", "keyboardinterrupt",
)
