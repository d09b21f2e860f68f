"""How many tokens the drafter drafts per cycle (the ``draft_len`` option)."""

from __future__ import annotations


class DraftWindow:
    """Tokens drafted per cycle: ``draft_len`` fixed, or ``auto``, which adapts as transformers'
    assisted generation does: two more after a cycle whose drafted tokens were all kept, one
    fewer after a cycle that threw drafted tokens away (an ensemble replaced one of them).

    Members that often disagree waste a long window's tail at every replacement; members that
    agree pay a verifier call per few tokens with a short one. The window a position is verified
    in decides how much text follows it, and a verifier's tokenization (and so alignment and its
    own next token) can depend on that text, so ``auto`` may give other texts than a fixed
    window; a fixed ``draft_len`` gives exactly the texts it always gave."""

    START = 5
    LARGEST = 12

    def __init__(self, draft_len: int | str):
        self.adaptive = draft_len == "auto"
        self.size = self.START if self.adaptive else int(draft_len)
        self.largest = self.LARGEST if self.adaptive else self.size
        self.rejected = False

    def update(self) -> None:
        if self.adaptive:
            self.size = max(1, self.size - 1) if self.rejected else min(self.largest, self.size + 2)
        self.rejected = False

    def size_if_kept(self) -> int:
        """The next cycle's window should this one's drafted tokens all be kept."""
        return min(self.largest, self.size + 2) if self.adaptive else self.size

    def forget_margin(self) -> int:
        """Verifier rows older than this many tokens before the end can no longer be asked for:
        a later cycle re-tokenizes at most its window plus the BPE merges across the old end."""
        return 2 * self.largest + 4
