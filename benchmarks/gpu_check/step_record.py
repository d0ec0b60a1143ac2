"""Step record: one NCCL rank under `dtwatch run`: the ring's sequence numbers against torch's counter, an
all_reduce in flight behind GPU work and then completed, and what a functional collective leaves in the ring."""
from __future__ import annotations

import sys

from common import CPU, WORKERS, Step, dtwatch_run, read_json, tracebacks

LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 60


def check_seq(step: Step, facts: dict) -> None:
    seq = facts.get("seq")
    if not seq:
        step.check("worker ran its collectives", False, facts.get("errors"))
        return
    calls, ring = seq["calls"], seq["ring"]
    recs = [r for r in ring["records"] if r["group"] == (ring["group"] or {}).get("name")]
    pairs = [{"op": c["op"], "torch": c["torch_seq"], "ring": (recs[i]["op"], recs[i]["last_seq"]) if i < len(recs)
              else None} for i, c in enumerate(calls)]
    step.check("ring: one record per call, each carrying torch's sequence number after it",
               len(recs) == len(calls) and all(p["ring"] == (p["op"], p["torch"]) for p in pairs),
               {"calls": len(calls), "records": len(recs), "torch vs ring": pairs})
    group = ring["group"] or {}
    open_recs = [(r["op"], r["seq"]) for r in recs if r["t_exit"] == 0]
    step.check("ring: the group's last sequence number is torch's counter; nothing left in flight",
               ring["last_seq"] == seq["torch_seq"] and not open_recs,
               {"ring last_seq": ring["last_seq"], "torch": seq["torch_seq"], "in flight": open_recs, "group": group})
    step.info("ring backend and group", {"backend": ring["backend"], "group": group})
    if CPU:
        step.skip("ring: NCCL group completion-tracked, completed up to torch's counter")
    else:
        step.check("ring: NCCL group completion-tracked, completed up to torch's counter",
                   group.get("tracked") is True and group.get("completed_seq") == seq["torch_seq"], group)


def check_inflight(step: Step, facts: dict) -> None:
    names = ["all_reduce behind ~2 s of matmuls returns at once",
             "while the GPU works: the ring shows it enqueued, not completed",
             "after the GPU finished: the ring shows it completed"]
    if CPU:
        for name in names:
            step.skip(name)
        return
    fl = facts.get("inflight") or {}
    mid, after = fl.get("mid") or {}, fl.get("after") or {}
    m = (mid.get("records") or [{}])[-1]
    a = (after.get("records") or [{}])[-1]
    returned = fl.get("call_returned_after_s")
    step.check(names[0], returned is not None and returned < 0.5 and (fl.get("gpu_busy_ms") or 0) > 1500,
               {k: fl.get(k) for k in ("call_returned_after_s", "gpu_busy_ms", "matmuls", "matmul_ms")}
               | {"errors": facts.get("errors")})
    step.check(names[1], m.get("op") == "all_reduce" and m.get("enqueued") and m.get("t_exit") == 0
               and (mid.get("group") or {}).get("completed_seq", 0) < (m.get("seq") or 0),
               {"last record": m, "group": mid.get("group")})
    done_after = (a.get("t_exit") or 0) - (fl.get("issued_at") or 0)
    step.check(names[2], a.get("seq") == m.get("seq") and (a.get("t_exit") or 0) > 0 and done_after > 1.0
               and (after.get("group") or {}).get("completed_seq", 0) >= (a.get("seq") or 1),
               {"last record": a, "group": after.get("group"), "completed after issue, s": round(done_after, 3),
                "synced after issue, s": round((fl.get("synced_at") or 0) - (fl.get("issued_at") or 0), 3)})


def check_funcol(step: Step, facts: dict) -> None:
    fc = facts.get("funcol") or {}
    new = fc.get("new_records") or []
    step.check("functional all_reduce: the ring holds a record with op all_reduce",
               any(r["op"] == "all_reduce" for r in new),
               {"new records": [(r["op"], r["seq"], r["line"]) for r in new], "result": fc.get("result"),
                "torch seq before/after": (fc.get("torch_seq_before"), fc.get("torch_seq_after")),
                "group after": fc.get("group"),
                "errors": [e for e in facts.get("errors", []) if "funcol" in e]}, advisory=True)


def main() -> None:
    step = Step("record", "1-rank job under dtwatch run: sequence numbers, in-flight completion, functional collective")
    out = step.dir / "facts.json"
    rc, text, _run_dir = dtwatch_run("record", [str(WORKERS / "record.py"), str(out)], 1, step, timeout=LIMIT - 8,
                                     watch=["--stall-window", "10"])
    step.check("job exits 0 under dtwatch run, no traceback", rc == 0 and not tracebacks(text),
               {"exit": rc, "tracebacks": tracebacks(text)[:3]})
    facts = read_json(out) or {}
    step.check("dtwatch installed in the worker by dtwatch run", facts.get("installed") is True,
               {"installed": facts.get("installed"), "backend": facts.get("backend"), "errors": facts.get("errors")})
    check_seq(step, facts)
    check_inflight(step, facts)
    check_funcol(step, facts)
    step.done()


if __name__ == "__main__":
    main()
