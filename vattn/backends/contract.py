"""The backend contract as a plain check (no test runner needed): pages
mapped, written through a tensor view, unmapped, mapped again elsewhere and
read back, and the zero page mapped and read, at every page size the backend
takes.  The test suite runs it on
each backend; `vattn bench gpu` runs it first on the GPU."""
import torch

from vattn.backends.base import Backend

PAGE_SIZES = [4096, 64 << 10, 256 << 10, 2 << 20, 4 << 20]


class ContractBroken(AssertionError):
    pass


def check(backend: Backend) -> list[int]:
    """Raise `ContractBroken` naming what failed; the page sizes checked."""
    sizes = [p for p in PAGE_SIZES if p % backend.granularity == 0] or [backend.granularity]
    for page_size in sizes:
        map_write_unmap(backend, page_size)
    return sizes


def map_write_unmap(backend: Backend, page_size: int) -> None:
    res = backend.reserve(4 * page_size, zero_backed=backend.zero_backing)
    pool = backend.create_pool(4, page_size)
    view = backend.tensor(res, torch.uint8, (res.nbytes,), (1,))
    backend.map(res, pool, [page_size, 3 * page_size], [2, 0])
    _expect(int(view[page_size:2 * page_size].sum()) == 0, page_size, "fresh pages do not read as zeros")
    view[page_size:page_size + 5] = 7
    view[3 * page_size] = 9
    backend.unmap(res, pool, [page_size, 3 * page_size])
    # the bytes live in the physical pages: map them elsewhere and read them back
    backend.map(res, pool, [0, 2 * page_size], [2, 0])
    _expect(view[:5].tolist() == [7] * 5 and int(view[2 * page_size]) == 9, page_size,
            "pages mapped at a second address do not hold what was written through the first")
    backend.unmap(res, pool, [0, 2 * page_size])
    # the zero page reads as zeros wherever it goes, even where a written page was, and leaves again
    backend.map_zero(res, pool, [0, 3 * page_size])
    _expect(int(view[:page_size].sum()) == 0 and int(view[3 * page_size:].sum()) == 0, page_size,
            "the zero page does not read as zeros")
    backend.unmap(res, pool, [0, 3 * page_size])
    backend.map(res, pool, [0], [2])
    _expect(view[:5].tolist() == [7] * 5, page_size, "a page mapped where the zero page was lost its bytes")
    backend.unmap(res, pool, [0])


def _expect(ok: bool, page_size: int, what: str) -> None:
    if not ok:
        raise ContractBroken(f"pages of {page_size} bytes: {what}")
