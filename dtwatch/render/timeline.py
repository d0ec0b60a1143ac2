"""A picture of the drift: per-rank sequence progress of each group over time, as a standalone SVG.

Each rank is a line of its group's sequence number against time (from its recent calls); a blocked
rank's line ends in a long flat segment up to the detection time, marked red for culprits and amber
for ranks waiting on them. The picture shows at a glance who stopped where.
"""
from __future__ import annotations

from html import escape

from dtwatch.diagnose import Finding
from dtwatch.diagnose.rank_state import RankState

PALETTE = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
CULPRIT, WAITING = "#d62728", "#ff7f0e"


def render_svg(states: list[RankState], findings: list[Finding], *, now: float, group: str | None = None,
               width: int = 900, row_height: int = 0) -> str:
    stall = next((f for f in findings if f.severity == "stall"), None)
    group = group or (stall.group if stall and stall.group else "0")
    culprits = set(stall.ranks) if stall else set()
    waiting = set(stall.waiting_ranks) if stall else set()
    series: dict[int, list[tuple[float, int]]] = {}
    for s in states:
        g = s.groups.get(group)
        if g is None:
            continue
        pts = [(c.t_enter, c.seq) for c in g.recent]
        if group == "0":  # step markers carry the default group's seq: C++-issued (DDP/FSDP) progress
            # strict=False: states read back from older bundles may lack step_seqs
            pts += [(t, q) for t, q in zip(s.step_times, s.step_seqs, strict=False) if q]
        if g.cpp_seq and g.cpp_seq_time:
            pts.append((g.cpp_seq_time, g.cpp_seq))
        pts.sort()
        series[s.rank] = pts
    all_pts = [p for pts in series.values() for p in pts]
    caption = _wrap(stall.summary, 150)[:4] if stall else []
    top = 40 + 15 * len(caption)
    height = top + 300 + max(0, 18 * len(series) - 200)
    left, right, bottom = 70, 220, 50
    if not all_pts:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="80">'
                f'<text x="10" y="40">no collectives recorded in group {escape(group)}</text></svg>')
    t0 = min(t for t, _ in all_pts)
    t1 = max(now, max(t for t, _ in all_pts)) + 1e-6
    s0 = min(q for _, q in all_pts)
    s1 = max(q for _, q in all_pts) + 1  # ints
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(t: float) -> float:
        return left + (t - t0) / (t1 - t0) * plot_w

    def y(q: float) -> float:
        return top + plot_h - (q - s0) / max(s1 - s0, 1) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="22" font-size="15" font-weight="bold">Sequence progress, group {escape(group)}'
           f'{" — " + escape(stall.kind) if stall else ""}</text>',
           f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#333"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#333"/>',
           f'<text x="{left + plot_w / 2}" y="{height - 15}" text-anchor="middle">'
           'seconds (0 = first call shown)</text>',
           f'<text x="15" y="{top + plot_h / 2}" transform="rotate(-90 15 {top + plot_h / 2})" '
           'text-anchor="middle">seq</text>']
    for line_no, text in enumerate(caption):
        out.append(f'<text x="{left}" y="{40 + 15 * line_no}" font-size="11">{escape(text)}</text>')
    for i in range(6):
        tv = t0 + (t1 - t0) * i / 5
        out.append(f'<text x="{x(tv):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{tv - t0:.1f}</text>')
    step = max(1, -(-(s1 - s0) // 5))  # integer ticks, at most ~6
    for qv in range(s0, s1 + 1, step):
        out.append(f'<text x="{left - 8}" y="{y(qv) + 4:.1f}" text-anchor="end">{qv}</text>')
    if stall and stall.onset:
        ox = x(stall.onset)
        out.append(f'<line x1="{ox:.1f}" y1="{top}" x2="{ox:.1f}" y2="{top + plot_h}" stroke="{CULPRIT}" '
                   'stroke-dasharray="4 3"/>')
        out.append(f'<text x="{ox + 4:.1f}" y="{top + 12}" fill="{CULPRIT}">last progress</text>')
    by_rank = {st.rank: st for st in states}
    legend = sorted(series)
    # Culprits last, so their lines are drawn on top of the ranks waiting at the same sequence number.
    for rank, pts in sorted(series.items(), key=lambda kv: (kv[0] in culprits, kv[0])):
        i = legend.index(rank)
        color = CULPRIT if rank in culprits else WAITING if rank in waiting else PALETTE[i % len(PALETTE)]
        if not pts:
            continue
        path = [f"M{x(pts[0][0]):.1f},{y(pts[0][1]):.1f}"]
        for tb, qb in pts[1:]:  # a step line: flat until the next call, then up to its seq
            path.append(f"H{x(tb):.1f}V{y(qb):.1f}")
        path.append(f"H{x(now):.1f}")
        stroke_width = 3 if rank in culprits else 1.5
        out.append(f'<path d="{" ".join(path)}" fill="none" stroke="{color}" stroke-width="{stroke_width}"/>')
        last_t, last_q = pts[-1]
        out.append(f'<circle cx="{x(now):.1f}" cy="{y(last_q):.1f}" r="3" fill="{color}"/>')
        role = " culprit" if rank in culprits else " waiting" if rank in waiting else ""
        call = by_rank[rank].blocking_call() if rank in by_rank else None
        op = f"{call.op} " if call is not None else ""
        label = f"rank {rank}: {escape(op)}seq {last_q}{role}"
        out.append(f'<text x="{left + plot_w + 10}" y="{top + 14 + 18 * i}" fill="{color}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + ([line] if line else [])


def render_html(svg: str, report_text: str) -> str:
    return ("<!doctype html><html><head><meta charset='utf-8'><title>dtwatch report</title></head><body>"
            f"{svg}<pre>{escape(report_text)}</pre></body></html>")
