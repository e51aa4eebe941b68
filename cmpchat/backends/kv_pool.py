"""The shared KV-cache pool's bookkeeping: fixed-size pages, reference counts, and each sequence's page list.

Pure Python, no device: both backends keep their K/V in pages of `page_tokens` tokens and ask this module
which page a token lands in. A sequence only ever appends, so a page that is full never changes again and can
be shared by every sequence that read the same prefix (a saved prefix and the conversations resumed from it).
A partial last page is shared too, until someone appends to it: `PageList.reserve` then gives the appender a
page of its own and says which page to copy into it (copy on write), so a saved prefix costs no KV copy at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cmpchat.errors import CmpchatError


class PoolExhausted(CmpchatError):
    """No free page is left for a sequence to grow into."""


class PagePool:
    """`total_pages` pages of `page_tokens` tokens; each page is free or held by one or more sequences."""

    def __init__(self, total_pages: int, page_tokens: int) -> None:
        if total_pages < 1 or page_tokens < 1:
            raise ValueError("a pool needs at least one page of at least one token")
        self.total_pages = total_pages
        self.page_tokens = page_tokens
        self._free = list(range(total_pages - 1, -1, -1))
        self._holders = [0] * total_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def total_tokens(self) -> int:
        return self.total_pages * self.page_tokens

    def pages_for(self, tokens: int) -> int:
        """Pages that `tokens` tokens take."""
        return -(-tokens // self.page_tokens)

    def allocate(self) -> int:
        if not self._free:
            raise PoolExhausted(f"the KV cache's {self.total_pages} pages of {self.page_tokens} tokens are all in use")
        page = self._free.pop()
        self._holders[page] = 1
        return page

    def retain(self, page: int) -> None:
        if self._holders[page] < 1:
            raise ValueError(f"page {page} is free")
        self._holders[page] += 1

    def release(self, page: int) -> None:
        if self._holders[page] < 1:
            raise ValueError(f"page {page} is free already")
        self._holders[page] -= 1
        if self._holders[page] == 0:
            self._free.append(page)

    def is_shared(self, page: int) -> bool:
        return self._holders[page] > 1


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy the first `tokens` tokens of page `source` into page `target` (the copy-on-write of a partial page)."""

    source: int
    target: int
    tokens: int


@dataclass(slots=True)
class PageList:
    """The pages holding one sequence's first `length` tokens, in token order."""

    pool: PagePool
    pages: list[int] = field(default_factory=list)
    length: int = 0

    def pages_to_grow(self, tokens: int) -> int:
        """Free pages `grow(tokens)` would take (a shared partial last page counts once)."""
        new = self.pool.pages_for(self.length + tokens) - len(self.pages)
        return new + (1 if tokens and self._last_page_is_shared_partial() else 0)

    def grow(self, tokens: int) -> list[PageCopy]:
        """Take the pages for `tokens` more tokens and count them in `length`; returns the copies the caller
        must make before writing them, in order. Nothing changes when the pool cannot hold them."""
        copies: list[PageCopy] = []
        length = self.length + tokens
        needed = self.pages_to_grow(tokens)
        if needed > self.pool.free_pages:
            raise PoolExhausted(
                f"{length} tokens need {needed} more KV pages of {self.pool.page_tokens} tokens "
                f"but {self.pool.free_pages} of {self.pool.total_pages} are free"
            )
        if tokens <= 0:
            return copies
        if self._last_page_is_shared_partial():
            old = self.pages[-1]
            new = self.pool.allocate()
            self.pool.release(old)
            self.pages[-1] = new
            copies.append(PageCopy(old, new, self.length % self.pool.page_tokens))
        while len(self.pages) < self.pool.pages_for(length):
            self.pages.append(self.pool.allocate())
        self.length = length
        return copies

    def share(self) -> PageList:
        """A second list over the same pages (a saved prefix, or a sequence resumed from one)."""
        for page in self.pages:
            self.pool.retain(page)
        return PageList(self.pool, list(self.pages), self.length)

    def release(self) -> None:
        for page in self.pages:
            self.pool.release(page)
        self.pages.clear()
        self.length = 0

    def _last_page_is_shared_partial(self) -> bool:
        return bool(self.pages) and self.length % self.pool.page_tokens != 0 and self.pool.is_shared(self.pages[-1])
