"""The C core (`vattn._native`) under extreme integers: request tables,
counts, starts, lengths, offsets, page sizes, windows and thread counts of
0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -2**63, the call's own
boundaries and small values, through the Python wrappers (the tensors supply
addresses and strides; a matrix of no rows names no memory, so its columns and
stride may be anything).  Each call either refuses (ValueError; OSError where
the OS refuses a reservation or a pool) with nothing written, or returns what
a reference computes.  The fuzz runs in a subprocess with a fixed seed, so a
call that corrupts memory shows as the subprocess dying, not as this process."""
import os
import re
import subprocess
import sys
from array import array
from collections import Counter

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vattn import _native
from vattn.binding import attend, request_table, view
from vattn.backends import HostBackend, MapLimitError
import vattn.binding as binding
import vattn.executor.gemm as gemm
from vattn.binding import rows as matrix

EXTREMES = (0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -2**63)
EXAMPLES = {"attend": 250, "ops": 80, "decoder": 40, "host": 100}  # each fuzz's examples, ops' for each op
CALLS = Counter()


def test_native_calls_refuse_or_answer_right_under_extreme_integers():
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, f"the fuzz died ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    print(run.stdout)
    assert int(re.search(r"(\d+) native calls", run.stdout)[1]) > 1000


def extreme(*near: int):
    """An extreme integer, or one of `near` (the boundaries of the call at hand)."""
    return st.sampled_from(EXTREMES + near)


THREADS = st.none() | extreme(2, 3)  # None: the wrapper's own count, torch's


def call(fn, *args, refusals=(ValueError,)):
    """fn(*args), counted: (True, its result), or (False, the refusal it raised)."""
    CALLS["calls"] += 1
    try:
        return True, fn(*args)
    except refusals as e:
        CALLS["refused"] += 1
        return False, e


def hollow(draw, address: int) -> tuple:
    """A float32 matrix of no rows at `address`, of extreme columns and stride: it names no memory."""
    cols = draw(extreme())
    return address, 0, 0, cols, draw(extreme(cols))


def fuzz(name: str):
    """The settings of a fuzz: its number of examples, drawn from a fixed seed."""
    return settings(max_examples=EXAMPLES[name], database=None, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------ attention

T, H, HKV, D, SLOTS, ROWS = 4, 4, 2, 16, 2, 12
TALL = 2**56  # the rows of an expanded K/V (every row the same memory): its elements still fit int64
COST = 4096  # rows a valid call may read in all; beyond, it is not made (it would run for hours)


def takes(r: list[int], slots: int, rows: int) -> bool:
    """Whether attend takes request r = (slot, start, length, q_first, num_q)."""
    slot, start, length, first, n = r
    return (0 <= slot < slots and min(start, first, n) >= 0 and n <= length <= rows
            and (n == 0 or start <= length - n) and first + n <= T)


def rows_read(r: list[int], window: int):
    """(token, lo, hi) of each query of request r: it reads rows [lo, hi)."""
    slot, start, length, first, n = r
    for t in range(n):
        pos = length - n + t
        yield first + t, max(start, pos + 1 - window) if window else start, pos + 1


def attention_reference(q, K, V, reqs, scale, window) -> dict[int, torch.Tensor]:
    """{query row: its [H, D] float32 output} for the rows exactly one request names."""
    named = Counter(token for r in reqs for token, _, _ in rows_read(r, window))
    expected = {}
    for r in reqs:
        for token, lo, hi in rows_read(r, window):
            k, v = (X[r[0], lo:hi].float().repeat_interleave(H // HKV, 1) for X in (K, V))
            p = torch.softmax(torch.einsum("rhd,hd->hr", k, q[token].float()) * scale, -1)
            expected[token] = torch.einsum("hr,rhd->hd", p, v)
    return {token: out for token, out in expected.items() if named[token] == 1}


@st.composite
def request_tables(draw, slots: int, rows: int) -> list[list[int]]:
    """Requests attend takes, some with a field pushed to an extreme or a boundary."""
    table = []
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(0, min(T, rows)))
        length = draw(st.integers(n, rows))
        r = [draw(st.integers(0, slots - 1)), max(0, length - n - draw(st.integers(0, 300))), length,
             draw(st.integers(0, T - n)), n]
        if draw(st.booleans()):
            r[draw(st.integers(0, 4))] = draw(extreme(slots, rows, rows + 1, T, T + 1, length, length + 1))
        table.append(r)
    return table


@given(st.data())
@fuzz("attend")
def fuzz_attend(data):
    draw = data.draw
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    kind = draw(st.sampled_from(["real", "tall", "hollow"]))
    window, threads = draw(st.just(0) | st.integers(1, 40) | extreme(7, 300)), draw(THREADS)
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    q = torch.randn(T, H, D, generator=g).to(dtype)
    out = torch.full_like(q, 7.0)
    K, V = (torch.randn(SLOTS, 1 if kind == "tall" else ROWS, HKV, D, generator=g).to(dtype) for _ in "kv")
    before = q.clone(), out.clone(), K.clone(), V.clone()
    if kind == "tall":
        K, V = K.expand(SLOTS, TALL, HKV, D), V.expand(SLOTS, TALL, HKV, D)
    rows = TALL if kind == "tall" else ROWS
    if kind == "hollow":  # K/V of no slots or no rows: any other size and stride
        sizes = [draw(extreme(SLOTS, HKV, D)) for _ in range(4)]
        sizes[draw(st.integers(0, 1))] = 0
        kv = [(X.data_ptr(), view("k", X, 4)[1], *sizes, *(draw(extreme()) for _ in range(4))) for X in (K, V)]
        table = [[draw(extreme(1, 2)) for _ in range(5)] for _ in range(draw(st.integers(0, 2)))]
    else:
        kv = [view("k", K, 4), view("v", V, 4)]
        table = draw(request_tables(SLOTS, rows))
    new = draw(st.booleans()) and kind == "real"
    new_k, new_v = (torch.randn(T, HKV, D, generator=g).to(dtype) for _ in "kv") if new else (None, None)
    valid = window >= 0 and all(takes(r, SLOTS, rows) for r in table) and kind != "hollow"
    if valid and sum(hi - lo for r in table for _, lo, hi in rows_read(r, window)) > COST:
        CALLS["skipped: too long to run"] += 1
        return
    flat = request_table(table)
    if threads is None and kind != "hollow":
        ok, _ = call(attend, q, K, V, flat, 0.25, window, out, new_k, new_v)
    else:
        news = (view("new_k", new_k, 3), view("new_v", new_v, 3)) if new else ()
        ok, _ = call(_native.attend, view("q", q, 3), view("out", out, 3), *kv, flat, 0.25, window,
                     torch.get_num_threads() if threads is None else threads, *news)
    if kind == "hollow":  # refused or not (such sizes are the kernel's to judge), it writes nothing
        assert torch.equal(out, before[1])
        return
    assert ok == valid, f"{'took' if ok else 'refused'} {table} window {window}"
    q0, out0, K0, V0 = before
    for slot, _, length, first, n in table if ok and new else ():  # each query token's K/V at its row
        K0[slot, length - n:length], V0[slot, length - n:length] = new_k[first:first + n], new_v[first:first + n]
    assert torch.equal(q, q0) and torch.equal(K[:, :K0.shape[1]], K0) and torch.equal(V[:, :V0.shape[1]], V0)
    if not ok:
        assert torch.equal(out, out0)
        return
    expected = attention_reference(q, K, V, table, 0.25, window)
    for token in range(T):
        if token in expected:
            err = (out[token].float() - expected[token]).abs().max()
            assert err <= (1e-5 if dtype == torch.float32 else 2e-2) * max(1.0, expected[token].abs().max()), token
        elif not any(token in range(r[3], r[3] + r[4]) for r in table):
            assert torch.equal(out[token], out0[token])


# ------------------------------------------------------------ the fused operators and the GEMM

def ops_call(draw, wrapper, native, tensors, arrange) -> tuple[bool, bool]:
    """One call of an op: through its wrapper, or natively (extreme threads, or one of `tensors`, the
    (name, tensor or None) it takes, as a hollow matrix); `arrange` puts the matrices in the native
    call's order.  Returns (whether it returned, whether a matrix was hollow)."""
    threads = draw(THREADS)
    hollow_at = draw(st.sampled_from([None, None, None] + [i for i, (_, t) in enumerate(tensors) if t is not None]))
    if threads is None and hollow_at is None:
        return call(wrapper)[0], False
    args = [None if t is None else matrix(name, t) for name, t in tensors]
    if hollow_at is not None:
        args[hollow_at] = hollow(draw, args[hollow_at][0])
    threads = torch.get_num_threads() if threads is None else threads
    return call(native, *arrange(args), threads)[0], hollow_at is not None


def settle(ok: bool, hollowed: bool, valid: bool, written: list, before: list) -> bool:
    """Whether a call wrote its answer (to be checked): one refused, or over a hollow matrix (whose
    other tensors then have no rows to write either), left `written` as it was."""
    if not ok or hollowed:
        assert hollowed or not valid, "a valid call was refused"
        assert all(torch.equal(a, b) for a, b in zip(written, before)), "a refused call wrote"
        return False
    assert valid, "an invalid call was taken"
    return True


@given(st.data())
@fuzz("ops")
def fuzz_rms_norm(data):
    draw = data.draw
    rows, cols = draw(st.integers(0, 3)), draw(st.integers(1, 40))
    x, w = torch.randn(rows, cols), torch.randn(cols + draw(st.sampled_from([0, 0, 1])))
    residual = draw(st.sampled_from([None, rows, rows + 1]))
    residual = None if residual is None else torch.randn(residual, cols)
    written = [t for t in (x, residual) if t is not None]
    before = [t.clone() for t in written]
    ok = ops_call(draw, lambda: binding.rms_norm(x, w, 1e-5, residual), _native.rms_norm,
                  [("x", x), ("residual", residual), ("weight", w)], lambda a: (*a, 1e-5))
    valid = w.numel() == cols and (residual is None or residual.shape == x.shape)
    if settle(*ok, valid, written, before):
        h = before[0] + (0 if residual is None else before[1])
        torch.testing.assert_close(x, F.rms_norm(h, (cols,), w, 1e-5), rtol=2e-6, atol=2e-6)
        assert residual is None or torch.equal(residual, h)


@given(st.data())
@fuzz("ops")
def fuzz_silu_mul(data):
    draw = data.draw
    rows, width = draw(st.integers(0, 3)), draw(st.integers(1, 40))
    gate_up = torch.randn(rows, 2 * width + draw(st.sampled_from([0, 0, 1])))
    out = torch.full((rows + draw(st.sampled_from([0, 0, 1])), width), 7.0)
    before = [out.clone()]
    ok = ops_call(draw, lambda: binding.silu_mul(gate_up, out), _native.silu_mul,
                  [("out", out), ("gate_up", gate_up)], lambda a: a)
    if settle(*ok, gate_up.shape == (rows, 2 * width) and out.shape[0] == rows, [out], before):
        torch.testing.assert_close(out, F.silu(gate_up[:, :width]) * gate_up[:, width:], rtol=2e-6, atol=1e-6)


@given(st.data())
@fuzz("ops")
def fuzz_rotate(data):
    draw = data.draw
    rows, heads, dim = draw(st.integers(0, 3)), draw(st.integers(1, 4)), draw(st.sampled_from([2, 6, 16]))
    said = draw(st.just(heads) | st.integers(1, 8) | extreme(heads * dim))  # the heads the call names
    x = torch.randn(rows, heads * dim)
    cos, sin = (torch.randn(rows + draw(st.sampled_from([0, 0, 1])), dim) for _ in "cs")
    before = [x.clone()]
    ok = ops_call(draw, lambda: binding.rotate(x, said, cos, sin), _native.rotate,
                  [("x", x), ("cos", cos), ("sin", sin)], lambda a: (a[0], said, a[1], a[2]))
    d = heads * dim // said if said >= 1 else 0
    valid = said >= 1 and heads * dim % said == 0 and d % 2 == 0 and d <= 256 and cos.shape == sin.shape == (rows, d)
    if settle(*ok, valid, [x], before):
        xh, half = before[0].view(rows, said, d), d // 2
        expected = xh * cos[:, None] + torch.cat((xh[..., half:], xh[..., :half]), -1) * sin[:, None]
        assert torch.equal(x.view(rows, said, d), expected)  # rounded as transformers does


@given(st.data())
@fuzz("ops")
def fuzz_linear(data):
    draw = data.draw
    rows, n, k = draw(st.integers(0, 3)), draw(st.integers(1, 60)), draw(st.integers(1, 20))
    x, w = torch.randn(rows, k), torch.randn(n, k)
    cols = n + draw(st.sampled_from([0, 0, -1, 1, gemm.PANEL]))  # out's columns: past n, the panels' zeros
    bias = draw(st.sampled_from([None, cols, cols + 1]))
    bias = None if bias is None else torch.randn(bias)
    out = torch.full((rows + draw(st.sampled_from([0, 0, 1])), cols), 7.0)
    panels = gemm.pack(w)
    before = [out.clone()]
    ok = ops_call(draw, lambda: _native.linear(matrix("out", out), matrix("x", x), *binding.weight(panels, bias),
                                               torch.get_num_threads()),
                  _native.linear, [("out", out), ("x", x), ("panels", panels.view(-1, gemm.PANEL)), ("bias", bias)],
                  lambda a: a)
    valid = (out.shape[0] == rows and -(-cols // gemm.PANEL) == panels.shape[0]
             and (bias is None or bias.numel() == cols))
    if settle(*ok, valid, [out], before):
        padded = torch.cat((w, torch.zeros(max(cols - n, 0), k)))[:cols]
        expected = F.linear(x.double(), padded.double(), None if bias is None else bias.double()).float()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------ the decoder layers

@given(st.data())
@fuzz("decoder")
def fuzz_decoder(data):
    """One layer, its requests, sampled rows, heads, threads and step buffers pushed to extremes: a
    refusal leaves the step's buffers and the cache as they were (what the call computes is
    test_forward's to check)."""
    draw = data.draw
    heads, kv_heads, dim, hidden, inter, steps = 2, 1, 16, 16, 48, 2
    g = torch.Generator().manual_seed(0)
    keep = []  # the tensors the matrices' addresses point into

    def rows(*shape):
        keep.append(torch.randn(*shape, generator=g))
        return matrix("rows", keep[-1])

    def weight(n, k):
        keep.append(gemm.pack(torch.randn(n, k, generator=g) * 0.1).view(-1, gemm.PANEL))
        return matrix("panels", keep[-1])

    K, V = torch.zeros(2, 16, kv_heads, dim), torch.zeros(2, 16, kv_heads, dim)
    layer = (weight((heads + 2 * kv_heads) * dim, hidden), None, weight(hidden, heads * dim), None,
             weight(2 * inter, hidden), None, weight(hidden, inter), None, rows(hidden), 1e-5, rows(hidden), 1e-5,
             view("k", K, 4), view("v", V, 4), 0.25, draw(st.just(0) | extreme()))
    step = [rows(steps, c) for c in (hidden, hidden, (heads + 2 * kv_heads) * dim, heads * dim, hidden, 2 * inter,
                                     inter, hidden, dim, dim)]
    written = keep[-len(step):] + [K, V]
    before = [t.clone() for t in written]
    table = [[0, 0, steps, 0, steps]]
    if draw(st.booleans()):
        table[0][draw(st.integers(0, 4))] = draw(extreme(2, 16, 17, steps))
    sampled = [steps - 1] if draw(st.booleans()) else draw(st.lists(extreme(steps), max_size=2))
    hollow_at = draw(st.none() | st.integers(0, len(step) - 1))
    if hollow_at is not None:
        step[hollow_at] = hollow(draw, step[hollow_at][0])
    ok, _ = call(_native.decoder_layers, (layer,), *step, request_table(table), array("q", sampled),
                 draw(st.just(heads) | extreme(heads + 1)), draw(st.sampled_from([1, 2]) | extreme()))
    if ok:
        assert torch.isfinite(written[0][:len(sampled)]).all()
    else:
        assert all(torch.equal(a, b) for a, b in zip(written, before))


# ------------------------------------------------------------ the host backend

@given(st.data())
@fuzz("host")
def fuzz_host(data):
    """Reservations and pools of extreme sizes; then batches of extreme offsets and pages over a small
    reservation and pool, each checked against a model of what every offset maps."""
    draw = data.draw
    b, page = HostBackend(), HostBackend.granularity
    size = draw(extreme(page, 2 * page, 2**46, 2**62) | st.integers(0, 4).map(lambda p: p * page))
    ok, res = call(b.reserve, size, draw(st.booleans()), refusals=(ValueError, OSError))
    if ok:
        assert res.nbytes == size
    elif isinstance(res, OSError):  # the address space, not the mapping limit, which is far from here
        assert not isinstance(res, MapLimitError) and "could not reserve" in str(res), res
    del res
    # a pool's bytes past int64 are an OverflowError of the conversion to C
    call(b.create_pool, draw(extreme(1, 4)), draw(extreme(page, 3 * page)),
         refusals=(ValueError, OSError, OverflowError))

    slots, pages = 6, 4
    res, pool = b.reserve(slots * page, zero_backed=True), b.create_pool(pages, page)
    for p in range(pages):
        os.pwrite(pool.fd, bytes([p + 1]) * page, p * page)
    content = {p: p + 1 for p in range(pages)}  # each page of the pool: one byte over
    mapped = {}  # reservation offset -> pool page, or None: the zero page
    memory = b.tensor(res, torch.uint8, (slots * page,), (1,))
    offsets = st.integers(0, slots).map(lambda i: i * page) | extreme(slots * page, 2**63 - page, 2**62)
    numbers = st.integers(0, pages) | extreme(2**63 // page - 1, 2**63 // page)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["map", "map_zero", "unmap", "release", "page size"]))
        at = draw(st.lists(offsets, max_size=3))
        numbered = draw(st.lists(numbers, min_size=len(at), max_size=len(at)))
        snapshot = memory.clone()
        if op == "map":
            ok, _ = call(b.map, res, pool, at, numbered)
            changes = dict(zip(at, numbered))
        elif op == "map_zero":
            ok, _ = call(b.map_zero, res, pool, at)
            changes = dict.fromkeys(at)
        elif op == "unmap":
            ok, _ = call(b.unmap, res, pool, at)
            changes = {}
            if ok:
                for o in at:
                    mapped.pop(o, None)
        elif op == "release":
            ok, _ = call(b.release, pool, numbered)
            changes = {}
            if ok:
                content.update(dict.fromkeys(numbered, 0))
        else:  # a page size of the call's own: the pool's first pages, two at a time
            ok, _ = call(_native.map_pages, res, pool.file, draw(extreme(2 * page)), at, [0] * len(at))
            changes = {o + i * page: i for o in at for i in range(2)}
        if ok:
            mapped.update(changes)
        else:
            assert torch.equal(memory, snapshot), op
        for o in range(0, slots * page, page):
            expected = 0 if mapped.get(o) is None else content[mapped[o]]
            assert int(memory[o]) == int(memory[o + page - 1]) == expected, (op, o)
        assert all(os.pread(pool.fd, 1, p * page)[0] == content[p] for p in range(pages)), op


# ------------------------------------------------------------ single calls at the edges

def known_cases():
    """Calls at the edge of a bound check's arithmetic: each is refused or does nothing."""
    q, K = torch.randn(T, H, D), torch.randn(SLOTS, ROWS, HKV, D)
    out = torch.full_like(q, 7.0)
    for r in ([0, 0, 4, 2**63 - 1, 1], [0, 0, 4, 2**63 - 2, 2], [1, 2**63 - 1, 4, 0, 1], [0, 0, 2**63 - 1, 0, 1]):
        assert not call(attend, q, K, K, request_table([r]), 0.25, 0, out)[0]
        assert torch.equal(out, torch.full_like(q, 7))
    # no queries over 2**63 - 1 K/V heads of no rows: nothing to run, and not a loop over the heads
    empty = (q.data_ptr(), 0, 0, 2**63 - 1, D, 0, 0, 1)
    assert call(_native.attend, empty, empty, (K.data_ptr(), 0, 1, 0, 2**63 - 1, D, 0, 0, 0, 1),
                (K.data_ptr(), 0, 1, 0, 2**63 - 1, D, 0, 0, 0, 1), request_table([[0, 0, 0, 0, 0]]), 0.25, 0, 1)[0]
    # sizes and strides that span more than an address holds
    assert not call(_native.attend, (q.data_ptr(), 0, T, H, D, 2**62, D, 1), view("out", out, 3), view("k", K, 4),
                    view("k", K, 4), request_table([]), 0.25, 0, 1)[0]
    assert not call(_native.silu_mul, (q.data_ptr(), 0, 2, 8, 2**62), matrix("gate_up", torch.randn(2, 16)), 1)[0]
    page = _native.os_page_size()
    res, file = _native.Reservation(4 * page, True), _native.PhysicalFile(2 * page)
    for size in (page, 2 * page):  # offset + page size past int64
        assert not call(_native.map_pages, res, file, size, [2**63 - size], [0])[0]
    assert not call(_native.unmap_pages, res, page, [2**63 - page])[0]
    assert not call(_native.punch_pages, file, 2 * page, [2**63 - page])[0]
    top = 2**64 - 1  # a range that wraps the address space, and one of no whole page at its top
    assert not call(_native.page_out, top - page + 1, page)[0] and call(_native.page_out, top, 0) == (True, 0)
    assert not call(_native.dlpack, res, top, 2, 1, 0)[0]


if __name__ == "__main__":
    known_cases()
    for run in (fuzz_attend, fuzz_rms_norm, fuzz_silu_mul, fuzz_rotate, fuzz_linear, fuzz_decoder, fuzz_host):
        run()
        print(f"{run.__name__}: {CALLS['calls']} calls so far", flush=True)
    print(f"{CALLS['calls']} native calls, {CALLS['refused']} refused; {dict(CALLS)}")
