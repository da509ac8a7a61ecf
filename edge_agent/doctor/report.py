"""What one doctor check says (:class:`Check`: a status, what was found, and what to
do about it) and how the doctor prints a list of them (:func:`render`)."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def render(checks: list[Check]) -> str:
    lines = []
    width = max(len(c.name) for c in checks)
    for c in checks:
        lines.append(f"[{c.status:^4}] {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in (FAIL, WARN):
            lines.append(f"{'':7}{'':<{width}}  -> {c.fix}")
    failed = [c.name for c in checks if c.failed]
    lines.append("")
    lines.append(f"{len(failed)} problem(s): {', '.join(failed)}" if failed else "everything needed to run this agent looks right")
    return "\n".join(lines)
