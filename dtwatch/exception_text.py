"""What an exception says, told short and whole: its type, its message cut at a sentence boundary,
the lines of a long message that carry the facts, and where it was really raised.

Two shapes of message hide the information past the first line, where a plain cut loses it:

* a DataLoader worker's exception is re-raised in the main process as ``Caught ValueError in
  DataLoader worker process 1.\\nOriginal Traceback (most recent call last): ...\\nValueError: corrupt
  sample 1261``: the original exception is the traceback's last line, and the worker's frames say
  where it was raised (:func:`worker_origin`);
* torch's own long errors end with the facts after paragraphs of advice: DDP's "Parameter indices
  which did not receive grad for rank 1: 2 3", NCCL's "Duplicate GPU detected : rank 1 and rank 0
  both on CUDA device 1000" (:data:`KEY_LINES`).

Pure text: used by the recorder (the ring's 256-byte exit reason) and the diagnosis (the sentence), no
torch, no I/O.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_WORKER = re.compile(r"^Caught (?P<type>[\w.]+) in (?P<origin>DataLoader worker process \d+)\.\s*"
                     r"Original Traceback \(most recent call last\):\n(?P<tb>.*)$", re.S)
_TB_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')
_TB_LAST = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<message>.*))?$")

# Lines of torch's long error messages that name what went wrong on which rank (matched anywhere in the
# message, kept whole even when the advice around them is cut).
KEY_LINES = (
    re.compile(r"Parameter indices which did not receive grad for rank \d+:[\d\s]*"),
    re.compile(r"Parameters which did not receive grad for rank \d+:[^\n]*"),
    re.compile(r"Duplicate GPU detected\s*:[^\n.]*"),
    re.compile(r"Multiple [Rr]anks are using the same (GPU|device)[^\n.]*"),
    re.compile(r"[Rr]ank \d+ and rank \d+ both on CUDA device [0-9a-fA-F]+"),
)

_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")


@dataclass(frozen=True)
class Raised:
    """An exception as the diagnosis tells it."""

    type: str  # the original exception's type name (a DataLoader worker's, not the re-raise's)
    message: str  # its whole message, whitespace as raised
    origin: str = ""  # where it was raised when not in the main thread ("DataLoader worker process 1")
    frames: tuple[dict, ...] = field(default_factory=tuple)  # innermost first: {"file", "line", "function"}

    def text(self, limit: int = 300) -> str:
        """``Type: message`` (see :func:`short_message`) and its origin."""
        msg = short_message(self.message, limit)
        head = f"{self.type}: {msg}" if msg else self.type
        return f"{head} (in {self.origin})" if self.origin else head


def worker_origin(type_name: str, message: str) -> Raised | None:
    """The original exception of a DataLoader worker, from the message torch re-raised it with."""
    m = _WORKER.match(message.strip("\n"))
    if not m:
        return None
    lines = m.group("tb").rstrip("\n").splitlines()
    frames = [{"file": f.group("file"), "line": int(f.group("line")), "function": f.group("function").strip()}
              for f in map(_TB_FRAME.match, lines) if f]
    # The exception line is the first unindented line after the last frame (its message may span lines).
    last_frame = max((i for i, ln in enumerate(lines) if _TB_FRAME.match(ln)), default=-1)
    rest = [ln for ln in lines[last_frame + 1:] if not ln.startswith(" ")] if last_frame >= 0 else lines
    rest_text = "\n".join(rest).strip()
    head = _TB_LAST.match(rest_text.split("\n", 1)[0]) if rest_text else None
    original = m.group("type")
    if head and head.group("type").split(".")[-1] == original.split(".")[-1]:
        message = rest_text.split(":", 1)[1].strip() if ":" in rest_text.split("\n", 1)[0] else ""
    else:
        message = rest_text
    return Raised(type=original.split(".")[-1], message=message, origin=m.group("origin"),
                  frames=tuple(reversed(frames)))


def raised(type_name: str, message: str, frames: list[dict] | tuple[dict, ...] = ()) -> Raised:
    """The exception to tell: a DataLoader worker's original, else this one."""
    return worker_origin(type_name, message) or Raised(type=type_name, message=message, frames=tuple(frames))


def short_message(message: str, limit: int = 300) -> str:
    """The message on one line: whole sentences from its start up to ``limit`` characters (the first
    sentence whole however long, up to three times ``limit``), then each key line (:data:`KEY_LINES`)
    not already included, after an ellipsis. Never cut inside a sentence unless one sentence is longer
    than three times ``limit``; then at a word, with an ellipsis."""
    text = message.strip()
    if not text:
        return ""
    sentences = _sentences(text)
    out: list[str] = []
    used = 0
    for s in sentences:
        if out and used + len(s) + 1 > limit:
            break
        out.append(s)
        used += len(s) + 1
    head = " ".join(out)
    if len(head) > 3 * limit:
        head = head[: 3 * limit].rsplit(" ", 1)[0] + " ..."
    kept = " ".join(out)
    keys = [k for k in key_lines(text) if k not in kept]
    cut = len(out) < len(sentences)
    if keys:
        return head + (" ... " if cut else " ") + " ".join(keys)
    return head + (" ..." if cut and not head.endswith("...") else "")


def key_lines(message: str) -> list[str]:
    """The fact-carrying lines of a long torch error (:data:`KEY_LINES`), in order, once each."""
    found: list[tuple[int, str]] = []
    for pattern in KEY_LINES:
        for m in pattern.finditer(message):
            found.append((m.start(), " ".join(m.group(0).split())))
    out: list[str] = []
    for _, text in sorted(found):
        if text and not any(text in k or k in text for k in out):
            out.append(text)
    return out


def _sentences(text: str) -> list[str]:
    """``text`` split after each sentence end (., ! or ? before whitespace) and at line breaks,
    whitespace collapsed; a file's "name.py:12" or a version "2.15" is not an end."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        piece = " ".join(text[start:m.end()].split())
        if piece:
            out.append(piece)
        start = m.end()
    tail = " ".join(text[start:].split())
    if tail:
        out.append(tail)
    return out


def fit_utf8(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8 at a character boundary."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore")
