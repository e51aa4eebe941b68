"""The KV pool's bookkeeping: pages come back when the last holder lets go, a shared partial page is copied
before anyone appends to it, and a list that cannot grow changes nothing."""

from __future__ import annotations

import pytest

from cmpchat.backends.kv_pool import PageCopy, PageList, PagePool, PoolExhausted


def test_growing_takes_pages_as_tokens_cross_page_boundaries() -> None:
    pool = PagePool(8, page_tokens=4)
    pages = PageList(pool)
    assert pages.pages_to_grow(5) == 2
    assert pages.grow(5) == [] and pages.length == 5 and len(pages.pages) == 2
    assert pages.pages_to_grow(3) == 0 and pages.pages_to_grow(4) == 1
    pages.grow(3)
    assert pool.free_pages == 6
    pages.release()
    assert pool.free_pages == 8 and pages.length == 0


def test_a_shared_prefix_keeps_its_pages_until_both_let_go() -> None:
    pool = PagePool(8, page_tokens=4)
    original = PageList(pool)
    original.grow(8)  # two full pages
    saved = original.share()
    assert pool.free_pages == 6
    original.release()
    assert pool.free_pages == 6  # the saved prefix still holds them
    saved.release()
    assert pool.free_pages == 8


def test_appending_to_a_shared_partial_page_copies_it_first() -> None:
    pool = PagePool(8, page_tokens=4)
    original = PageList(pool)
    original.grow(6)  # page 0 full, page 1 holds 2 tokens
    fork = original.share()
    assert fork.pages_to_grow(1) == 1  # its own copy of the partial page
    copies = fork.grow(1)
    assert copies == [PageCopy(source=original.pages[1], target=fork.pages[1], tokens=2)]
    assert fork.pages[0] == original.pages[0] and fork.pages[1] != original.pages[1]
    assert original.grow(1) == []  # the original is the only holder of its partial page now
    assert pool.free_pages == 5


def test_a_full_pool_refuses_and_leaves_the_list_as_it_was() -> None:
    pool = PagePool(2, page_tokens=4)
    pages = PageList(pool)
    pages.grow(6)
    with pytest.raises(PoolExhausted, match="1 more KV pages of 4 tokens but 0 of 2 are free"):
        pages.grow(4)
    assert pages.length == 6 and len(pages.pages) == 2
