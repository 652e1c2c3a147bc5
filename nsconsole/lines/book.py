"""Every line the console shows (`LineBook`)."""

from __future__ import annotations

from collections.abc import Iterator

from nsconsole.lines.family import lineage
from nsconsole.lines.view import LineView


class LineBook:
    """Every line the console shows, by key, in a stable order: by path, each branch right after the
    line it was forked from (`nsconsole.lines.family.lineage`)."""

    def __init__(self) -> None:
        self.lines: dict[str, LineView] = {}

    def __iter__(self) -> Iterator[LineView]:
        parents = {line.path: line.parent for line in self.lines.values()}
        return iter(sorted(self.lines.values(), key=lambda line: lineage(line.path, parents)))

    def __len__(self) -> int:
        return len(self.lines)

    def get(self, key: str) -> LineView | None:
        return self.lines.get(key)

    def add(self, line: LineView) -> LineView:
        return self.lines.setdefault(line.key, line)

    def remove(self, key: str) -> LineView | None:
        """Leave a line out (its directory was removed); the line, or None when it was not shown."""
        return self.lines.pop(key, None)
