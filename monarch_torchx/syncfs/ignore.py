"""Which paths of a tree a sync leaves out: TorchX's ``.torchxignore`` rules.

A TorchX workspace names what not to ship in ``.torchxignore`` (``.dockerignore`` syntax, as
TorchX's own workspace walker reads it: ``fnmatch`` patterns on paths relative to the root,
``!`` re-includes, the last matching line wins). syncfs honours the same file so a workspace
synced to a pool holds what TorchX would have put in an image, and ``sync --exclude`` adds
patterns of its own.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field

IGNORE_FILE = ".torchxignore"


@dataclass
class IgnoreRules:
    patterns: list[str] = field(default_factory=list)

    @classmethod
    def for_tree(cls, root: str, extra: Sequence[str] = ()) -> IgnoreRules:
        """The rules of ``root/.torchxignore`` (if there is one), then ``extra``."""
        from ..errors import MonarchError

        patterns: list[str] = []
        path = os.path.join(root, IGNORE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    line = line.partition("#")[0].strip()
                    if line and line != ".":
                        patterns.append(line)
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError) as e:
            raise MonarchError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}; fix or remove it") from None
        return cls(patterns + [p for p in extra if p])

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def ignored(self, rel: str) -> bool:
        """Whether the path ``rel`` (relative to the root, '/'-separated) is left out; a left-out
        directory is left out whole."""
        rel = posixpath.normpath(rel)
        out = False
        for p in self.patterns:
            if p.startswith("!"):
                if fnmatch.fnmatch(rel, p[1:].rstrip("/")):
                    out = False
            elif fnmatch.fnmatch(rel, p.rstrip("/")):
                out = True
        return out
